"""Whole models from torchvision and transformers under torch.compile(model, backend="kgen"): does each compile,
how much of it do kgen's partitions take, and is its output eager's.

    PYTHONPATH=. python bench/models_backend.py --suite torchvision --out reports/ [--models resnet18,vit_b_16]
        [--batch 2] [--device cuda] [--training | --step] [--reps 20]
    PYTHONPATH=. python bench/models_backend.py --suite transformers --out reports/ [--models bert,llama] [--seq 64]

Each model runs in a child process of its own (a fresh Dynamo and kgen; KGEN_CACHE as set), with random weights
(seed 0). torchvision: the model with its defaults, a normal input [batch, 3, 224, 224] (299 for inception_v3), a
linear layer initialized to zeros (ViT's head) drawn normal instead (else the output is zeros whatever comes before
it); --step runs one training step (cross entropy on random labels, backward) instead of a forward. transformers:
small configurations of each architecture (TRANSFORMERS below), token ids [batch, seq] (an encoder-decoder's decoder
ids too), pixels or audio features; its last hidden state or logits compared. In eval mode under torch.no_grad()
unless --training. Per model: the first call's seconds (trace, import, plan, render, build), the output's largest
difference from eager's over eager's largest value (the gradients' with --step), the partitions the backend made and
how many are kgen modules, the calls they hold, the reasons of those left to PyTorch; with --reps on a GPU, median ms
of eager and of the compiled model (CUDA events, the two in turns). Writes SUITE_backend.json and .md under --out
(SUITE_backend_step.* with --step).
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

TORCHVISION = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x0_5",
               "efficientnet_b0", "regnet_y_400mf", "densenet121", "convnext_tiny", "googlenet", "mnasnet0_5", "vit_b_16",
               "swin_t")
# name: (model class, config class, the config's sizes, inputs: ids, encoder-decoder ids, pixels or audio features)
SMALL_LM = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                vocab_size=1000)
TRANSFORMERS = {
    "bert": ("BertModel", "BertConfig", {}, "ids"),
    "distilbert": ("DistilBertModel", "DistilBertConfig", {}, "ids"),
    "roberta": ("RobertaModel", "RobertaConfig", dict(num_hidden_layers=4), "ids"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}, "ids"),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(SMALL_LM, hidden_size=512, intermediate_size=1376, num_hidden_layers=4),
              "ids"),
    "mistral": ("MistralForCausalLM", "MistralConfig", SMALL_LM, "ids"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", SMALL_LM, "ids"),
    "t5": ("T5Model", "T5Config", dict(d_model=256, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=4,
                                       vocab_size=1000), "encoder-decoder"),
    "whisper": ("WhisperModel", "WhisperConfig", dict(d_model=128, encoder_layers=2, decoder_layers=2,
                                                      encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=1000,
                                                      max_source_positions=100, pad_token_id=1, bos_token_id=2,
                                                      eos_token_id=3, decoder_start_token_id=2), "audio"),
    "vit": ("ViTModel", "ViTConfig", {}, "pixels"),
    "convnext": ("ConvNextModel", "ConvNextConfig", dict(depths=[1, 1, 1, 1]), "pixels"),
}
SUITES = {"torchvision": TORCHVISION, "transformers": tuple(TRANSFORMERS)}
OWNER = {"torchvision": "torchvision's", "transformers": "transformers'"}


def build_torchvision(name: str, batch: int, seq: int, device: str):
    """(model, its call's keyword arguments, the output tensor of its result)."""
    import torch
    import torchvision

    kw = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
    model = getattr(torchvision.models, name)(**kw)
    with torch.no_grad():  # a layer initialized to zeros (ViT's head) would make the output zeros whatever came before
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and not m.weight.any():
                m.weight.normal_(0, m.in_features ** -0.5)
    side = 299 if name == "inception_v3" else 224
    return model, {"x": torch.randn(batch, 3, side, side, device=device)}, lambda y: y


def build_transformers(name: str, batch: int, seq: int, device: str):
    import torch
    import transformers

    model_class, config_class, sizes, inputs = TRANSFORMERS[name]
    config = getattr(transformers, config_class)(**sizes)
    model = getattr(transformers, model_class)(config)
    ids = lambda n: torch.randint(0, config.vocab_size, (batch, n), device=device)  # noqa: E731
    if inputs == "ids":
        kwargs = {"input_ids": ids(seq)}
    elif inputs == "encoder-decoder":
        kwargs = {"input_ids": ids(seq), "decoder_input_ids": ids(seq // 4)}
    elif inputs == "audio":
        kwargs = {"input_features": torch.randn(batch, config.num_mel_bins, 2 * config.max_source_positions, device=device),
                  "decoder_input_ids": ids(seq // 4)}
    else:
        side = config.image_size if hasattr(config, "image_size") else 64
        kwargs = {"pixel_values": torch.randn(batch, config.num_channels, side, side, device=device)}
    output = lambda o: o.logits if hasattr(o, "logits") else o.last_hidden_state  # noqa: E731
    return model, kwargs, output


def child(suite: str, name: str, batch: int, seq: int, device: str, training: bool, reps: int, step: bool) -> dict:
    """One model's row (in the child process)."""
    import torch
    from kgen.backend import backend_for_compile

    backend = backend_for_compile()
    torch.manual_seed(0)
    model, kwargs, output = (build_torchvision if suite == "torchvision" else build_transformers)(name, batch, seq, device)
    model = model.to(device).train(training or step)
    res = {"model": name}

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def training_step():  # cross entropy on random labels, backward, against eager's (the same dropout masks)
        reference = copy.deepcopy(model)
        target = torch.randint(0, 1000, (batch,), device=device)
        compiled = torch.compile(model, backend=backend)
        losses = []
        for m in (compiled, reference):
            torch.manual_seed(1)
            sync()
            t = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(output(m(**kwargs)), target)
            loss.backward()
            sync()
            res.setdefault("first_s", round(time.perf_counter() - t, 1))
            losses.append(float(loss))
        res["loss_diff"] = abs(losses[0] - losses[1])
        scale = max(float(q.grad.abs().max()) for q in reference.parameters() if q.grad is not None)
        res["max_diff_rel"] = max(float((p.grad - q.grad).abs().max()) / scale
                                  for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None)

    def inference():
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            sync()
            t = time.perf_counter()
            y = output(compiled(**kwargs))
            sync()
            res["first_s"] = round(time.perf_counter() - t, 1)
            ref = output(model(**kwargs))
        res["max_diff_rel"] = float((y - ref).abs().max() / ref.abs().max())
        if reps and device.startswith("cuda"):
            times = {"eager": [], "kgen": []}
            with torch.no_grad():
                for _ in range(3):
                    model(**kwargs), compiled(**kwargs)
                for _ in range(reps):
                    for form, fn in (("eager", model), ("kgen", compiled)):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        fn(**kwargs)
                        b.record()
                        b.synchronize()
                        times[form].append(a.elapsed_time(b))
            for form, ts in times.items():
                res[f"{form}_ms"] = round(sorted(ts)[len(ts) // 2], 3)

    try:
        training_step() if step else inference()
        import kgen.backend as backend

        parts = backend.PARTITIONS
        res["partitions"] = len(parts)
        res["in_kgen"] = sum(1 for p in parts if p.get("module"))
        res["calls_in_kgen"] = sum(len(p["calls"]) for p in parts if p.get("module"))
        res["left_eager"] = [(p.get("reason") or "")[:200] for p in parts if not p.get("module")]
    except Exception as e:  # noqa: BLE001 - the row says what failed
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        res["traceback"] = traceback.format_exc()[-2000:]
    return res


def markdown(rows: list, env: dict, args) -> str:
    what = ("one training step (cross entropy on random labels, backward)" if args.step else
            f"{'training' if args.training else 'eval'} mode")
    sizes = (f"batch {args.batch}" if args.suite == "torchvision" else
             f"batch {args.batch}, sequence {args.seq} (an encoder-decoder's decoder {args.seq // 4})")
    flags = f"--suite {args.suite}{' --step' if args.step else ''}{' --training' if args.training else ''}"
    lines = [
        f"# {OWNER[args.suite]} models under torch.compile(backend=\"kgen\")", "",
        f"commit {env['commit']}, {env['date']}, torch {env['torch']}, {args.suite} {env.get('library', env.get(args.suite))}, device "
        f"{args.device}, {sizes}, {what} (`bench/models_backend.py {flags}`). Random weights (seed 0); max diff: "
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
        diff = f"{r['max_diff_rel']:.1e}" if "max_diff_rel" in r else "-"
        lines.append(f"| {r['model']} | {r.get('first_s', '-')} | {diff} | {r.get('partitions', '-')} ({r.get('in_kgen', '-')}) | "
                     f"{r.get('calls_in_kgen', '-')} | {r.get('eager_ms', '-')} | {r.get('kgen_ms', '-')} | {err} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="torchvision")
    ap.add_argument("--models", default=None, help="comma-separated names (default: the suite's list above)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64, help="transformers: the token sequence's length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--training", action="store_true")
    ap.add_argument("--step", action="store_true",
                    help="torchvision: a training step (training mode, backward) instead: the gradients against eager's")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per form on a GPU (0: none)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per model")
    ap.add_argument("--out", type=Path, required=True, help="folder for SUITE_backend.json and .md")
    ap.add_argument("--markdown-only", action="store_true", help="write the .md again from the folder's .json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # (one model's row, in a child process)
    args = ap.parse_args()
    if args.step and args.suite != "torchvision":
        ap.error("--step: a classification loss, torchvision's models only")
    names = args.models.split(",") if args.models else list(SUITES[args.suite])
    if args.child:
        row = child(args.suite, names[0], args.batch, args.seq, args.device, args.training, args.reps, args.step)
        print("RESULT " + json.dumps(row))
        return
    stem = f"{args.suite}_backend" + ("_step" if args.step else "")
    if args.markdown_only:
        data = json.loads((args.out / f"{stem}.json").read_text())
        (args.out / f"{stem}.md").write_text(markdown(data["rows"], data["environment"], args))
        return

    import torch

    rows = []
    for name in names:
        cmd = [sys.executable, __file__, "--child", "--suite", args.suite, "--models", name, "--batch", str(args.batch),
               "--seq", str(args.seq), "--device", args.device, "--reps", str(args.reps), "--out", str(args.out)]
        cmd += ["--training"] * args.training + ["--step"] * args.step
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ.copy())
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"model": name, "error": f"exit {proc.returncode}: {proc.stderr[-400:]}"}
        except subprocess.TimeoutExpired:
            row = {"model": name, "error": f"no result in {args.timeout} s"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    try:
        library = __import__(args.suite).__version__
    except Exception:  # noqa: BLE001 - the children said what failed
        library = "?"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "library": library}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(rows, env, args))


if __name__ == "__main__":
    main()
