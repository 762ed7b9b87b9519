"""The serving side: the call an engine makes, its tuning and its table.

    inputs.py        serving-call inputs (make_input), the fp32 reference, CUDA-graph helpers
    call.py          the one serving call: Decoder and decode()
    decode_plan.py   DecodePlan: planned once, update() per step, run() per layer; graph-safe
    table.py         the serving table (tables/GPU.serving.yaml): schema, buckets, lookup
    estimate.py      the eager estimate: interpolation, and the backends' schedule models
                     (backends/*_schedule.py) applied and fitted without naming a backend
    config.py        the serving sweep's config (configs/serving.yaml)
    cells.py         its families, cells, units, shards and cost model
    gate.py          the correctness gate per (family, candidate), in worker processes
    results.py       the serving sweep's resumable results file
    measure.py       one measurement (build, cell input, probe, time) in a worker or in-process
    sweep.py         the serving sweep (mla-tune sweep hands it a serving config)
    build.py         results -> tables/GPU.serving.yaml, and merge of shards
    calibrate.py     the split-K reduction's cost per step on the table's GPU
    verify.py        mla-tune verify: the table's picks re-timed at held-out shapes
    rescore.py       mla-tune verify --rescore: picks scored on recorded verify reports
    render.py        mla-tune show / diff of serving tables, in 80 columns or JSON
    time_picks.py    mla-tune time mix / scan: picks or candidates checked and timed at given lengths

The leaderboard's side (tune/, tables/, runtime/, export/) imports nothing from here; the
old paths mla_tune.runtime.decode and mla_tune.runtime.plan re-export the call and the plan.
This module imports nothing, so `mla_tune.serving.table` loads without torch.
"""
