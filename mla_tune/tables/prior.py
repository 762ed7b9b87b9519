"""Where a GPU's prior is found: the untuned table `mla-tune export` writes before any sweep.

A prior (`configs/priors/NAME.yaml`) is table-shaped data whose provenance.kind is `prior`
(mla_tune/tables/table.py checks it like a table: rows with a winner, no times, and a
`prior.source` each). It is looked up, first hit wins, in the working directory's
`configs/priors/` and then in the packaged configs' `priors/` (a source checkout's
`configs/priors/`, mla_tune/locate.py). Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path

from mla_tune import locate

PRIOR_FOLDER = "priors"


def prior_dirs() -> list[Path]:
    """The folders a prior is looked up in, in order (the same directory once)."""
    found = [Path("configs") / PRIOR_FOLDER]
    packaged = locate.packaged_dir("configs")
    if packaged is not None:
        found.append(Path(packaged) / PRIOR_FOLDER)
    unique: list[Path] = []
    for folder in found:
        if all(folder.resolve() != seen.resolve() for seen in unique):
            unique.append(folder)
    return unique


def find_prior(gpu: str) -> Path | None:
    """The prior for GPU `gpu` (a canonical name such as MI355X), or None."""
    if not locate.is_gpu_name(gpu):
        return None
    for folder in prior_dirs():
        path = folder / f"{gpu}.yaml"
        if path.is_file():
            return path
    return None
