"""The compile sweep of v85 (CPU): every proper subset of the score options at hd128, bf16, for the
sm_90 (mma.sync tables) and sm_90a (wgmma) forward and backward, printing the variants that spill.
Run from the repository root: python bench/notes/v85-option-subsets-compile.py"""
import dataclasses, itertools
from cupyflash import _kernels, _compile
if __name__ == "__main__":
    feats = _kernels.FEATURES
    subsets = [tuple(f for f in feats if f in c) for r in range(1, len(feats)) for c in itertools.combinations(feats, r)]
    base = {}
    for arch, k in _kernels.compile_jobs():
        if k.tile is None or k.tile.headdim != 128 or k.pass_ not in ("fwd", "bwd") or not k.options or k.bias_tiles:
            continue
        if k.features != _kernels.FEATURES or k.even_k or k.dtype != "bfloat16":
            continue
        if not (arch == "90a" or arch == "90"):
            continue
        base[(arch, k.pass_, k.wgmma, k.tile, k.local, k.deterministic)] = (arch, k)
    jobs = []
    for arch, k in base.values():
        for sub in subsets:
            if k.pass_ == "fwd" and k.deterministic:
                continue
            jobs.append((arch, dataclasses.replace(k, features=sub)))
    jobs = list(dict.fromkeys(jobs))
    print(len(jobs), "jobs", flush=True)
    for arch, k, r in _compile.compile_all(jobs):
        if r.spills:
            print("SPILL", arch, k.name, r.registers, r.spills, flush=True)
    print("done", flush=True)
