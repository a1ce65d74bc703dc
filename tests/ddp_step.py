"""One DDP training step with a kgen module on two ranks (run by tests/test_autograd.py).

    python tests/ddp_step.py BACKEND OUT_DIR NAME [NAME...]

BACKEND is nccl (rank r on cuda:r) or gloo (CPU). Each rank takes its half of
one batch through DistributedDataParallel(Model()), backward on a linear loss
(so the gradient does not depend on forward rounding), and an SGD step; then the
hand-written model, eagerly, through DistributedDataParallel on the same halves
(the same shapes, so cuDNN picks the same algorithms: on two H200s the whole
batch's weight gradient, taken once on rank 0, differed from the halves' by up to
7e-4 of the largest gradient when the GPUs' free memory changed cuDNN's choice).
Every rank writes OUT_DIR/NAME-RANK.pt: its gradients and parameters after the
step, and the eager gradients. The test compares them.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
PER_RANK = 2


def _step(rank: int, device: torch.device, name: str, out_dir: Path) -> None:
    from handwritten import MODELS
    from kgen.ir import load_pipeline
    from kgen.validate import import_module_dir

    module = import_module_dir(ROOT / "generated" / name)
    pipe = load_pipeline(ROOT / "specs" / f"{name}.yaml")
    torch.manual_seed(0)
    model = module.Model().to(device)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(pipe.input.concrete(WORLD * PER_RANK), generator=gen)
    weight = torch.randn(pipe.output.concrete(WORLD * PER_RANK), generator=gen)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss = (ddp(x[part].to(device)) * weight[part].to(device)).sum()
    loss.backward()  # DDP averages the gradients over the ranks
    result = {"grads": {k: p.grad.detach().cpu() for k, p in model.named_parameters()}}
    torch.optim.SGD(ddp.parameters(), lr=0.01).step()
    result["params"] = {k: p.detach().cpu() for k, p in model.named_parameters()}
    hand = MODELS[name]().to(device)  # the same step, eagerly, on the same halves
    hand.load_state_dict(initial)
    ddp_hand = DistributedDataParallel(hand, device_ids=[rank] if device.type == "cuda" else None)
    (ddp_hand(x[part].to(device)) * weight[part].to(device)).sum().backward()
    result["eager_grads"] = {k: p.grad.detach().cpu() for k, p in hand.named_parameters()}
    torch.save(result, out_dir / f"{name}-{rank}.pt")


def _worker(rank: int, backend: str, out_dir: str, names: list, init_file: str) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.allow_tf32 = False  # compare fp32 with fp32
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for name in names:
            _step(rank, device, name, Path(out_dir))
        # both ranks past their last collective before either tears the group down: gloo's worker threads may still
        # hold the other's pending work, and its teardown then aborted a rank ("terminate called without an
        # active exception", seen once)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    backend, out_dir, *names = sys.argv[1:]
    init_file = Path(out_dir) / "dist-init"
    mp.spawn(_worker, args=(backend, out_dir, names, str(init_file)), nprocs=WORLD, join=True)
