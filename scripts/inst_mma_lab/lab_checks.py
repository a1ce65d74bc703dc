"""What the instnorm convolution labs share (run_wg32.py here, scripts/inst_wino_lab/run.py): instnorm's input
[N, 3, 16, 32, 32] in each kind of data, and a lab's conv3d + bias + max over the channels checked against float64
and against eager PyTorch."""
import torch

from scripts.host_probe import back_to_back_us  # run with PYTHONPATH=. (the repository root)

KINDS = [(3, "randn"), (2, "rand"), (2, "big"), (2, "inf"), (5, "ties"), (128, "randn")]  # (batch, kind)


def lab_input(batch: int, kind: str) -> torch.Tensor:
    """Normal, uniform, 1e30-scaled, integer (ties) data, or normal with an inf, a NaN and a -inf."""
    x = torch.randn(batch, 3, 16, 32, 32, device="cuda")
    if kind == "rand":
        x = torch.rand(batch, 3, 16, 32, 32, device="cuda")
    if kind == "big":
        x = x * 1e30
    if kind == "ties":
        x = torch.randint(-2, 3, x.shape, device="cuda").float()
    if kind == "inf":
        x[0, 1, 5, 7, 9] = float("inf"); x[1, 0, 3, 3, 3] = float("nan"); x[1, 2, 9, 20, 20] = -float("inf")
    return x


def check_conv_chanmax(lab, w: torch.Tensor, b: torch.Tensor, eager_fp32: bool = False) -> None:
    """Prints, per kind of data, lab(x)'s max relative error against float64 (beside eager's), whether it is
    allclose to eager at 1e-4, and whether it is non-finite exactly where float64 is. eager_fp32: eager's
    convolution with cuDNN's TF32 off (else PyTorch's default)."""
    for batch, kind in KINDS:
        x = lab_input(batch, kind)
        y = lab(x); torch.cuda.synchronize()
        ref = torch.nn.functional.conv3d(x.double(), w.double(), b.double()).amax(1)
        fin = torch.isfinite(ref)
        same_nonfinite = bool(((~torch.isfinite(y.double())) == (~fin)).all())
        err = ((y.double() - ref).abs() / (ref.abs() + 1))[fin].max().item()
        allow = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = allow and not eager_fp32
        eager = torch.nn.functional.conv3d(x, w, b).amax(1)
        torch.backends.cudnn.allow_tf32 = allow
        err_eager = ((eager.double() - ref).abs() / (ref.abs() + 1))[fin].max().item()
        ok = torch.allclose(y[fin], eager[fin], atol=1e-4, rtol=1e-4)
        print(f"{kind:5s} batch {batch:3d}: max rel err {err:.2e} (eager{' fp32' if eager_fp32 else ''}'s {err_eager:.2e}), "
              f"allclose(eager, 1e-4) {ok}, non-finite where float64's are {same_nonfinite} ({(~fin).sum().item()} such)")


def print_shipped_time(x: torch.Tensor) -> None:
    """The shipped instnorm_clamp_max module on x, back to back, for comparison (or why it could not run)."""
    try:
        from generated import instnorm_clamp_max as m
        model = m.Model().cuda()
        with torch.no_grad():
            print(f"shipped instnorm_clamp_max: back-to-back {back_to_back_us(lambda: model(x)):.1f} us")
    except Exception as e:  # noqa: BLE001 (a lab: report and go on)
        print("shipped module:", e)
