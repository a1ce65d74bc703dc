"""Per-tile phase times of a one-pass fused norm (conv_gemm:onepass), for the GPU machine:

    PYTHONPATH=. python bench/phase_times.py instnorm_clamp_max

Copies generated/ to a scratch folder, adds %globaltimer stamps to the copy's kernels (the CUDA main
loop of conv_gemm.cuh and the module's NormOnePass epilogue), builds it there and runs one call at the
spec's example batch. Each CTA writes its tiles' stamps to a device array and prints them after its
last tile, so the printing does not disturb the times of its own tiles (it slows the last round's, which
run while earlier CTAs print: read the rounds before it). Prints, per phase, the mean / median / max over
the tiles: waiting for the (last) input stage, the main loop, the moments, the arrival and wait for the
sample's other tiles, the merge, normalize and store; then when each sample ended. Stops with an error
if the templates no longer have the lines the stamps go after (update the anchors below).
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ["wait for the stage", "main loop", "moments", "arrive + wait", "merge", "normalize + store"]


def patch(text: str, old: str, new: str, where: str) -> str:
    if old not in text:
        sys.exit(f"phase_times: {where} no longer has the line the stamps go after:\n{old}")
    return text.replace(old, new, 1)


def instrument(gen: Path, name: str) -> None:
    cg = gen / "conv_gemm" / "conv_gemm.cuh"
    s = cg.read_text()
    s = "#include <cstdio>\n" + s
    s = patch(s, "namespace kgen {", """namespace kgen {
__device__ __forceinline__ unsigned long long pt_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ unsigned long long pt_cta[4096][8];    // the current tile's stamps, per CTA
__device__ unsigned long long pt_tile[65536][9];  // per tile: stamps 0-6, SM, CTA
""", "conv_gemm.cuh")
    s = patch(s, """      cp_async_wait<P::kStages - 2>();
      __syncthreads();  // stage s landed; everyone is done with stage s - 1 and s_lo
""", """      if (threadIdx.x == 0) pt_cta[blockIdx.x][0] = pt_now();
      cp_async_wait<P::kStages - 2>();
      __syncthreads();  // stage s landed; everyone is done with stage s - 1 and s_lo
      if (threadIdx.x == 0) pt_cta[blockIdx.x][1] = pt_now();
""", "conv_gemm.cuh (the main loop)")
    s = patch(s, """      if (chunk == G::kChunks - 1) {
        if constexpr (kSignal) {""", """      if (threadIdx.x == 0) pt_cta[blockIdx.x][2] = pt_now();
      if (chunk == G::kChunks - 1) {
        if constexpr (kSignal) {""", "conv_gemm.cuh (the tile's end)")
    s = patch(s, """        finish_tile(c, in);
      }
    }
    cp_async_wait<0>();""", """        finish_tile(c, in);
        if (threadIdx.x == 0) {
          unsigned sm;
          asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
          unsigned long long* row = pt_tile[c.n * G::kTilesPerSample + c.index];
          for (int i = 0; i < 6; ++i) row[i] = pt_cta[blockIdx.x][i];
          row[6] = pt_now();
          row[7] = sm;
          row[8] = blockIdx.x;
        }
      }
    }
    cp_async_wait<0>();
    if (G::kDirect && threadIdx.x == 0) {
      for (long long s = 0; s < steps; ++s) {
        const TileCoord c = tile_of_step(s);
        const unsigned long long* r = pt_tile[c.n * G::kTilesPerSample + c.index];
        printf("PT %llu %d %d %llu %llu %llu %llu %llu %llu %llu %llu\\n", r[8], c.n, c.index, r[7], r[0], r[1], r[2], r[3],
               r[4], r[5], r[6]);
      }
    }""", "conv_gemm.cuh (after the loop)")
    cg.write_text(s)
    kc = gen / name / "kernel.cu"
    s = kc.read_text()
    for i, old in ((3, "    team_sync<P>();  // the tile's moments are stored (and the scratch free for the statistics)\n"),
                   (4, "    team_sync<P>();  // after thread 0's acquire: the other tiles' moments are visible to the CTA (loads from L2)\n"),
                   (5, "    team_sync<P>();\n    normalize_store<true, P>(a, acc, fm, stats, c);\n")):
        stamp = f"    if (tid == 0) kgen::pt_cta[blockIdx.x][{i}] = kgen::pt_now();\n"
        new = old.replace("    normalize_store", stamp + "    normalize_store") if i == 5 else old + stamp
        s = patch(s, old, new, f"{kc} (NormOnePass)")
    kc.write_text(s)


RUN = """
import sys, torch
from pathlib import Path
from kgen.bench import models_and_inputs
from kgen.cli import _spec_of
d = Path(sys.argv[1])
_, _, model, _, inputs = models_and_inputs(d, _spec_of(d))
with torch.no_grad():
    for _ in range(3):
        model(*inputs)
    torch.cuda.synchronize()
    print("PT-MARK", flush=True)
    model(*inputs)
    torch.cuda.synchronize()
"""


def summarize(lines: list[str]) -> None:
    rows = [list(map(int, l.split()[1:])) for l in lines if l.startswith("PT ")]
    if not rows:
        sys.exit("phase_times: no stamps (is the plan conv_gemm:onepass?)")
    t0, t1 = min(r[4] for r in rows), max(r[10] for r in rows)
    print(f"{len(rows)} tiles; first stamp to last: {(t1 - t0) / 1e3:.1f} us (printing happens after each CTA's last tile)")
    for i, phase in enumerate(PHASES):
        d = [(r[5 + i] - r[4 + i]) / 1e3 for r in rows]
        print(f"  {phase:20s} mean {statistics.mean(d):6.2f} us  median {statistics.median(d):6.2f}  max {max(d):7.2f}")
    ends = defaultdict(int)
    for r in rows:
        ends[r[1]] = max(ends[r[1]], r[10])
    print("  samples ending (us from the first stamp):", " ".join(f"{(e - t0) / 1e3:.0f}" for e in sorted(ends.values())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", default="instnorm_clamp_max", help="a module under generated/ whose plan is conv_gemm:onepass")
    name = ap.parse_args().name
    with tempfile.TemporaryDirectory() as tmp:
        gen = Path(tmp) / "generated"
        shutil.copytree(ROOT / "generated", gen, ignore=shutil.ignore_patterns("_build"))
        shutil.copytree(ROOT / "specs", Path(tmp) / "specs")  # plan.json names its spec relative to generated/..
        instrument(gen, name)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        for cmd in ([sys.executable, "-m", "kgen", "build", "--out", str(gen), name], [sys.executable, "-c", RUN, str(gen / name)]):
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"phase_times: {' '.join(cmd[:4])} ... failed:\n{proc.stderr[-3000:]}")
        summarize(proc.stdout.split("PT-MARK", 1)[-1].splitlines())


if __name__ == "__main__":
    main()
