import sys, time, os, statistics, json
sys.path.insert(0, os.path.join(os.getcwd(), "src"))
import mmap
import numpy as np, torch
from vllm_hook.delivery.hostmem import host_empty, read_into
N, ROWS, H = 85, 256, 1536
n = 4 * ROWS * H
src = [np.random.randint(0, 1 << 15, size=n, dtype=np.uint16) for _ in range(4)]
paths = []
for i in range(4):
    p = f"/dev/shm/wp_{i}"
    src[i].tofile(p); paths.append(p)
MODE = ["np"]
def widen(a, dst):
    if MODE[0] == "np":
        np.left_shift(a, 16, out=dst.numpy().view(np.uint32), dtype=np.uint32)
    else:
        dst.copy_(torch.from_numpy(a).view(torch.bfloat16))
res = {}
for rnd in range(6):
    for how in ("torch_empty", "host_empty", "read_only", "read+empty", "read+host", "read+host+torch", "read+empty+torch", "mmap+host", "mmap+host+torch"):
        MODE[0] = "torch" if how.endswith("+torch") else "np"
        held = []
        t = time.perf_counter()
        for i in range(N):
            a = src[i % 4]
            if how.startswith("mmap"):
                fd = os.open(paths[i % 4], os.O_RDONLY)
                m = mmap.mmap(fd, 2 * n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
                os.close(fd)
                a = np.frombuffer(m, dtype=np.uint16)
                if how.endswith("torch"):
                    dst = host_empty((n,), torch.float32)
                    with __import__("warnings").catch_warnings():
                        __import__("warnings").simplefilter("ignore")
                        dst.copy_(torch.frombuffer(m, dtype=torch.bfloat16))
                else:
                    dst = host_empty((n,), torch.float32); widen(a, dst)
                del a
                m.close(); held.append(dst); continue
            if how.startswith("read"):
                buf = host_empty((2 * n,), torch.uint8)
                fd = os.open(paths[i % 4], os.O_RDONLY)
                read_into(fd, buf); os.close(fd)
                a = buf.numpy().view(np.uint16)
                if how == "read_only":
                    held.append(buf); continue
            dst = host_empty((n,), torch.float32) if "host" in how else torch.empty(n, dtype=torch.float32)
            widen(a, dst); held.append(dst)
        dt = (time.perf_counter() - t) / N * 1e3
        del held
        if rnd: res.setdefault(how, []).append(dt)
print(torch.get_num_threads(), json.dumps({k: [round(statistics.median(v), 3), round(min(v), 3)] for k, v in res.items()}))
for p in paths: os.remove(p)
