"""One-shot H100 prototype: which cuDNN formulation of each rewrite is fastest,
and does cuDNN keep NaN inside the receptive field. Not part of the product."""
import time, sys, json
import torch, torch.nn as nn, torch.nn.functional as F

dev = "cuda"
torch.manual_seed(0)
print(torch.__version__, torch.cuda.get_device_name(), "allow_tf32", torch.backends.cudnn.allow_tf32,
      "benchmark", torch.backends.cudnn.benchmark, flush=True)

def bench(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]

R = {}
def rec(k, fn, **kw):
    try:
        t = bench(fn, **kw)
    except Exception as e:  # noqa
        print(f"{k:55s} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True); return
    R[k] = t; print(f"{k:55s} {t:8.3f} ms", flush=True)

with torch.no_grad():
  for bm in (False, True):
    torch.backends.cudnn.benchmark = bm
    sfx = " [bench]" if bm else ""
    # ---- maxpool_sum: conv_transpose3d(32->64, k5, s2, p2) on 32^3, N=16
    x = torch.randn(16, 32, 32, 32, 32, device=dev)
    ct = nn.ConvTranspose3d(32, 64, 5, stride=2, padding=2).to(dev)
    rec("mps eager convT" + sfx, lambda: ct(x))
    w = ct.weight  # (Cin, Cout, 5,5,5)
    wf = w.flip(2, 3, 4)
    # per-phase: r=0 -> taps w[4],w[2],w[0] pad 1 ; r=1 -> taps w[3],w[1] pad 0
    sel = {0: (slice(0, 5, 2), 1), 1: (slice(1, 4, 2), 0)}
    phases = []
    for rz in (0, 1):
        for ry in (0, 1):
            for rx in (0, 1):
                wp = wf[:, :, sel[rz][0], sel[ry][0], sel[rx][0]].transpose(0, 1).contiguous()
                phases.append((wp, (sel[rz][1], sel[ry][1], sel[rx][1])))
    def phase_convs(xx=x, ph=phases):
        return [F.conv3d(xx, wp, ct.bias, padding=p) for wp, p in ph]
    rec("mps 8 phase conv3d NCDHW" + sfx, phase_convs)
    xcl = x.contiguous(memory_format=torch.channels_last_3d)
    ph_cl = [(wp.contiguous(memory_format=torch.channels_last_3d), p) for wp, p in phases]
    rec("mps 8 phase conv3d CL (input pre-converted)" + sfx, lambda: phase_convs(xcl, ph_cl))
    rec("mps 8 phase conv3d CL (incl. convert)" + sfx,
        lambda: phase_convs(x.contiguous(memory_format=torch.channels_last_3d), ph_cl))
    xc = x[:, :, :31, :31, :31].contiguous()
    rec("mps 8 phase conv3d NCDHW cropped31" + sfx, lambda: phase_convs(xc))
    # combined k3 conv, 512 out channels (not NaN-exact: zero taps)
    wc = torch.zeros(8 * 64, 32, 3, 3, 3, device=dev)
    rec("mps combined k3 conv 512 out" + sfx, lambda: F.conv3d(x, wc, None, padding=1))
    rec("mps combined k3 conv 512 out CL" + sfx, lambda: F.conv3d(xcl, wc.contiguous(memory_format=torch.channels_last_3d), None, padding=1))
    del x, xcl, xc
    # ---- avgpool: conv2d(8->64,k3) on 384^2, N=128, then avgpool 4
    x = torch.randn(128, 8, 384, 384, device=dev)
    cv = nn.Conv2d(8, 64, 3).to(dev)
    rec("avg eager conv" + sfx, lambda: cv(x))
    rec("avg eager conv+pool" + sfx, lambda: F.avg_pool2d(cv(x), 4))
    w6 = F.conv_transpose2d(cv.weight.reshape(512, 1, 3, 3), torch.ones(1, 1, 4, 4, device=dev)).reshape(64, 8, 6, 6) / 16
    rec("avg folded k6 s4 NCHW" + sfx, lambda: F.conv2d(x, w6, cv.bias, stride=4))
    xcl = x.contiguous(memory_format=torch.channels_last)
    w6cl = w6.contiguous(memory_format=torch.channels_last)
    rec("avg folded k6 s4 CL (pre-converted)" + sfx, lambda: F.conv2d(xcl, w6cl, cv.bias, stride=4))
    rec("avg folded k6 s4 CL (incl convert)" + sfx, lambda: F.conv2d(x.contiguous(memory_format=torch.channels_last), w6cl, cv.bias, stride=4))
    # space-to-depth: (N,8,96,4,96,4) -> (N,8*16,96,96); kernel 8x8 zero padded -> 2x2 over blocks
    w8 = F.pad(w6, (0, 2, 0, 2))  # (64,8,8,8)
    w_s2d = w8.reshape(64, 8, 2, 4, 2, 4).permute(0, 1, 3, 5, 2, 4).reshape(64, 128, 2, 2).contiguous()
    def s2d(xx):
        return xx.reshape(128, 8, 96, 4, 96, 4).permute(0, 1, 3, 5, 2, 4).reshape(128, 128, 96, 96)
    rec("avg s2d copy only" + sfx, lambda: s2d(x).contiguous())
    rec("avg s2d + conv k2 NCHW" + sfx, lambda: F.conv2d(s2d(x).contiguous(), w_s2d, cv.bias))
    def s2d_cl(xx):
        # NHWC of the s2d tensor: (N, 96, 96, 8,4,4)
        t = xx.reshape(128, 8, 96, 4, 96, 4).permute(0, 2, 4, 1, 3, 5).contiguous()
        return t.reshape(128, 96, 96, 128).permute(0, 3, 1, 2)
    w_s2d_cl = w_s2d.contiguous(memory_format=torch.channels_last)
    rec("avg s2d CL + conv k2" + sfx, lambda: F.conv2d(s2d_cl(x), w_s2d_cl, cv.bias))
    y = F.conv2d(x, w6, cv.bias, stride=4)
    ys = F.conv2d(s2d(x).contiguous(), w_s2d, cv.bias)
    print("s2d vs folded max err", (y - ys).abs().max().item(), "fold vs orig", (F.avg_pool2d(cv(x), 4) - y).abs().max().item(), flush=True)
    del x, xcl, y, ys
    # ---- relu_gn: conv_transpose3d(64->128, k3, s1) on 32^3, N=16
    x = torch.randn(16, 64, 32, 32, 32, device=dev)
    ct = nn.ConvTranspose3d(64, 128, 3, bias=False).to(dev)
    rec("rgn eager convT" + sfx, lambda: ct(x))
    wfl = ct.weight.flip(2, 3, 4).transpose(0, 1).contiguous()
    rec("rgn as conv3d pad2 NCDHW" + sfx, lambda: F.conv3d(x, wfl, None, padding=2))
    xcl = x.contiguous(memory_format=torch.channels_last_3d)
    rec("rgn as conv3d pad2 CL (pre-converted)" + sfx, lambda: F.conv3d(xcl, wfl.contiguous(memory_format=torch.channels_last_3d), None, padding=2))
    print("rgn conv-vs-convT err", (ct(x) - F.conv3d(x, wfl, None, padding=2)).abs().max().item())
    del x, xcl
    # ---- div_max: conv3d(8->16,k3) on (16,64,64), N=128
    x = torch.randn(128, 8, 16, 64, 64, device=dev)
    cv = nn.Conv3d(8, 16, 3).to(dev)
    rec("dmx eager conv" + sfx, lambda: cv(x))
    xcl = x.contiguous(memory_format=torch.channels_last_3d)
    rec("dmx conv CL (pre-converted)" + sfx, lambda: F.conv3d(xcl, cv.weight.contiguous(memory_format=torch.channels_last_3d), cv.bias))
    del x, xcl
    # ---- instnorm: conv3d(3->16,k3) on (16,32,32), N=128
    x = torch.randn(128, 3, 16, 32, 32, device=dev)
    cv = nn.Conv3d(3, 16, 3).to(dev)
    rec("inm eager conv" + sfx, lambda: cv(x))
    del x
  torch.backends.cudnn.benchmark = False

  # ---- NaN spread: one NaN input element; count NaN outputs vs receptive field
  def nan_spread(m, shape, pos):
      x = torch.randn(*shape, device=dev); x[pos] = float("nan")
      y = m(x); yd = m.double().cpu()(x.double().cpu()); m.float()
      return int(torch.isnan(y).sum()), int(torch.isnan(yd).sum())
  for name, mk, shape, pos in [
      ("mps", lambda: nn.ConvTranspose3d(32, 64, 5, stride=2, padding=2), (1, 32, 32, 32, 32), (0, 3, 10, 11, 12)),
      ("dmx", lambda: nn.Conv3d(8, 16, 3), (1, 8, 16, 64, 64), (0, 3, 5, 11, 12)),
      ("avg", lambda: nn.Conv2d(8, 64, 3), (1, 8, 384, 384), (0, 3, 100, 101)),
      ("rgn", lambda: nn.ConvTranspose3d(64, 128, 3, bias=False), (1, 64, 32, 32, 32), (0, 3, 10, 11, 12)),
      ("inm", lambda: nn.Conv3d(3, 16, 3), (1, 3, 16, 32, 32), (0, 1, 5, 11, 12))]:
      for tf in (True, False):
          torch.backends.cudnn.allow_tf32 = tf
          g, c = nan_spread(mk().to(dev), shape, pos)
          print(f"NaN spread {name} tf32={tf}: cuda {g} fp64-cpu {c}", flush=True)
  torch.backends.cudnn.allow_tf32 = True
json.dump(R, open(sys.argv[1], "w"), indent=1) if len(sys.argv) > 1 else None
