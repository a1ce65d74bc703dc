"""The first call of torch.compile(model, backend="kgen") on a KernelBench problem file, in this process:
Dynamo's trace, kgen's import, plan, render and build of each partition (or the cache's copy), then the call.

    KGEN_CACHE=$(mktemp -d) PYTHONPATH=. python bench/first_call.py PATH/level3/9_ResNet18.py
    (then again with the same KGEN_CACHE: a second process that finds everything built)

Prints one line: the first call's seconds, the second call's, the output's largest difference from eager's, and
the whole process's seconds. The model and inputs are the file's (Model(*get_init_inputs()), get_inputs()), on the
GPU where there is one (--device), in eval mode under torch.no_grad() unless --training.
"""
import argparse
import importlib.util
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a KernelBench problem file (Model, get_inputs, get_init_inputs)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    ap.add_argument("--training", action="store_true", help="training mode, as KernelBench's evaluator runs models")
    ap.add_argument("--backend", default="kgen",
                    help="torch.compile's backend (default kgen; eager: Dynamo's own share of the first call)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="the first call under cProfile: print its N costliest functions of kgen (cumulative time)")
    args = ap.parse_args()

    start = time.perf_counter()
    import torch
    from kgen.backend import backend_for_compile
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = importlib.util.spec_from_file_location("problem", args.file)
    problem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(problem)
    torch.manual_seed(0)
    model = problem.Model(*problem.get_init_inputs()).to(device).train(args.training)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in problem.get_inputs()]
    compiled = torch.compile(model, backend=backend_for_compile() if args.backend == "kgen" else args.backend)

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    with torch.no_grad():
        if args.profile:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            out, first = profile.runcall(timed, compiled)
            pstats.Stats(profile).sort_stats("cumulative").print_stats("kgen/", args.profile)
        else:
            out, first = timed(compiled)
        _, second = timed(compiled)
        ref = model(*inputs)
    diff = (out - ref).abs().max().item()
    print(f"first call {first:.1f} s, second call {second:.3f} s, max |kgen - eager| {diff:.2e}, "
          f"process {time.perf_counter() - start:.1f} s ({device})")


if __name__ == "__main__":
    main()
