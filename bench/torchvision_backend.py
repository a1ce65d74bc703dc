"""torchvision's classification models under torch.compile(model, backend="kgen"): does each compile, how much of
it do kgen's partitions take, and is its output eager's.

    PYTHONPATH=. python bench/torchvision_backend.py --out reports/ [--models resnet18,vit_b_16] [--batch 2]
        [--device cuda] [--training] [--reps 20]

Each model runs in a child process of its own (a fresh Dynamo and kgen; KGEN_CACHE as set): built with its
torchvision defaults (random weights, seed 0), the input a normal [batch, 3, 224, 224] (299 for inception_v3), in
eval mode under torch.no_grad() unless --training, or one training step with --step (a linear layer initialized to zeros, ViT's head, drawn normal
instead: else the output is zeros whatever comes before it). Per model: the first call's seconds (trace, import, plan, render,
build), the output's largest difference from eager's over eager's largest value, the partitions the backend made
and how many are kgen modules, the calls they hold, the reasons of those left to PyTorch; with --reps on a GPU,
median ms of eager and of the compiled model (CUDA events, the two in turns). Writes torchvision_backend.json and
.md under --out (torchvision_backend_step.* with --step).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x0_5",
          "efficientnet_b0", "regnet_y_400mf", "densenet121", "convnext_tiny", "googlenet", "mnasnet0_5", "vit_b_16",
          "swin_t")

CHILD = r"""
import json, sys, time, traceback
import torch, torchvision
import copy
name, batch, device, training, reps, step = (sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]),
                                             sys.argv[6] == "1")
torch.manual_seed(0)
kw = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
model = getattr(torchvision.models, name)(**kw).to(device).train(training)
with torch.no_grad():  # a layer initialized to zeros (ViT's head) would make the output zeros whatever came before
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not m.weight.any():
            m.weight.normal_(0, m.in_features ** -0.5)
x = torch.randn(batch, 3, 299 if name == "inception_v3" else 224, 224 if name != "inception_v3" else 299, device=device)
res = {"model": name}

def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()

def training_step():  # cross entropy on random labels, backward, against eager's (the same dropout masks)
    reference = copy.deepcopy(model)
    target = torch.randint(0, 1000, (batch,), device=device)
    compiled = torch.compile(model, backend="kgen")
    losses = []
    for m in (compiled, reference):
        torch.manual_seed(1)
        sync(); t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(m(x), target)
        loss.backward(); sync()
        res.setdefault("first_s", round(time.perf_counter() - t, 1))
        losses.append(float(loss))
    res["loss_diff"] = abs(losses[0] - losses[1])
    scale = max(float(q.grad.abs().max()) for q in reference.parameters() if q.grad is not None)
    res["max_diff_rel"] = max(float((p.grad - q.grad).abs().max()) / scale
                              for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None)


def inference():
    compiled = torch.compile(model, backend="kgen")
    with torch.no_grad():
        sync(); t = time.perf_counter(); y = compiled(x); sync()
        res["first_s"] = round(time.perf_counter() - t, 1)
        ref = model(x)
    res["max_diff_rel"] = float((y - ref).abs().max() / ref.abs().max())
    if reps and device.startswith("cuda"):
        times = {"eager": [], "kgen": []}
        with torch.no_grad():
            for _ in range(3):
                model(x), compiled(x)
            for _ in range(reps):
                for form, fn in (("eager", model), ("kgen", compiled)):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record(); fn(x); b.record(); b.synchronize()
                    times[form].append(a.elapsed_time(b))
        for form, ts in times.items():
            res[f"{form}_ms"] = round(sorted(ts)[len(ts) // 2], 3)


try:
    training_step() if step else inference()
except Exception as e:
    res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    res["traceback"] = traceback.format_exc()[-2000:]
try:
    import kgen.backend as backend
    parts = backend.PARTITIONS
    res["partitions"] = len(parts)
    res["in_kgen"] = sum(1 for p in parts if p.get("module"))
    res["calls_in_kgen"] = sum(len(p["calls"]) for p in parts if p.get("module"))
    res["left_eager"] = [(p.get("reason") or "")[:200] for p in parts if not p.get("module")]
except Exception as e:
    res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    res["traceback"] = traceback.format_exc()[-2000:]
print("RESULT " + json.dumps(res))
"""


def markdown(rows: list, env: dict, args) -> str:
    lines = [
        "# torchvision's models under torch.compile(backend=\"kgen\")", "",
        f"commit {env['commit']}, {env['date']}, torch {env['torch']}, torchvision {env['torchvision']}, device "
        f"{args.device}, batch {args.batch}, "
        + ("one training step (cross entropy on random labels, backward)" if args.step else
           f"{'training' if args.training else 'eval'} mode")
        + f" (`bench/torchvision_backend.py{' --step' if args.step else ''}`). Random weights (seed 0), a normal input; max diff: "
        + ("the gradients' largest difference from eager's over the largest gradient. First call: the step's trace, "
           "import, plan, render, build and backward" if args.step else
           "the output's largest difference from eager's over eager's largest value. First call: trace, import, "
           "plan, render and build") + " (a cold KGEN_CACHE unless said).", "",
        "| model | first call s | max diff | partitions (in kgen) | calls in kgen | eager ms | kgen ms | left to PyTorch / error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reasons = dict.fromkeys(why.split(" (")[0] for why in r.get("left_eager", []))  # without the estimates
        left = r.get("partitions", 0) - r.get("in_kgen", 0)
        err = r.get("error") or (f"{left} partition(s): " + "; ".join(reasons) if left else "")
        lines.append(f"| {r['model']} | {r.get('first_s', '-')} | {r['max_diff_rel']:.1e} |" if "max_diff_rel" in r
                     else f"| {r['model']} | {r.get('first_s', '-')} | - |")
        lines[-1] += (f" {r.get('partitions', '-')} ({r.get('in_kgen', '-')}) | {r.get('calls_in_kgen', '-')} | "
                      f"{r.get('eager_ms', '-')} | {r.get('kgen_ms', '-')} | {err} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated torchvision.models names")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--training", action="store_true")
    ap.add_argument("--step", action="store_true",
                    help="a training step (training mode, backward) instead: the gradients against eager's")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per form on a GPU (0: none)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per model")
    ap.add_argument("--out", type=Path, required=True, help="folder for torchvision_backend.json and .md")
    ap.add_argument("--markdown-only", action="store_true", help="write the .md again from the folder's .json")
    args = ap.parse_args()
    stem = "torchvision_backend_step" if args.step else "torchvision_backend"
    if args.markdown_only:
        data = json.loads((args.out / f"{stem}.json").read_text())
        (args.out / f"{stem}.md").write_text(markdown(data["rows"], data["environment"], args))
        return

    import torch

    rows = []
    for name in args.models.split(","):
        cmd = [sys.executable, "-c", CHILD, name, str(args.batch), args.device, "1" if args.training or args.step else "0",
               str(args.reps), "1" if args.step else "0"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ.copy())
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"model": name, "error": f"exit {proc.returncode}: {proc.stderr[-400:]}"}
        except subprocess.TimeoutExpired:
            row = {"model": name, "error": f"no result in {args.timeout} s"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    try:
        import torchvision
        tv = torchvision.__version__
    except Exception:  # noqa: BLE001 - the children said what failed
        tv = "?"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "torchvision": tv}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(rows, env, args))


if __name__ == "__main__":
    main()
