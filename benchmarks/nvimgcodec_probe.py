import time, io, numpy as np, torch, glob, os
print([p for p in glob.glob('/opt/torch/.venv/lib/python3.12/site-packages/**/libnvjpeg*', recursive=True)][:5])
from nvidia import nvimgcodec
from PIL import Image
from gpufeed.synth import natural_image
rng = np.random.default_rng(0)
datas = []
for i in range(64):
    b = io.BytesIO(); Image.fromarray(natural_image(rng, 375, 500, i)).save(b, format="JPEG", quality=90); datas.append(b.getvalue())
datas = datas * 4
for name, backends in [("hw", [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)]), ("gpu", [nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY)]), ("hybrid", [nvimgcodec.Backend(nvimgcodec.BackendKind.HYBRID_CPU_GPU)])]:
    try:
        dec = nvimgcodec.Decoder(backends=backends)
        out = dec.decode(datas)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            out = dec.decode(datas)
            imgs = [torch.as_tensor(o, device="cuda") for o in out]
        torch.cuda.synchronize()
        print(name, len(datas) * 8 / (time.perf_counter() - t0), "img/s", imgs[0].shape, imgs[0].dtype, imgs[0].stride(), sum(o is None for o in out))
    except Exception as e:
        print(name, "failed:", repr(e)[:300])
