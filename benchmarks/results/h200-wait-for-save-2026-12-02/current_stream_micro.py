"""What the compute thread's CUDA calls of wait_for_save cost on their own (torch, one H200):
torch.cuda.current_stream() against torch's raw (id, device, type) triple, an event record, and
two yardsticks; at rest, with another thread spinning in Event.synchronize, and with another
thread busy in Python (the GIL). Output: current_stream_micro.log."""
import threading, time, torch
dev = torch.device("cuda", 0)
torch.cuda.set_stream(torch.cuda.Stream())
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
def t(fn, n=2000):
    xs = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); xs.append(time.perf_counter() - t0)
    xs.sort(); return f"p50 {xs[len(xs)//2]*1e6:.1f} us p99 {xs[int(len(xs)*.99)]*1e6:.1f} us"
def report(label):
    print(label)
    print("  current_stream(dev)      ", t(lambda: torch.cuda.current_stream(dev)))
    print("  _cuda_getCurrentStream   ", t(lambda: torch._C._cuda_getCurrentStream(0)))
    print("  Event()+record(stream)   ", t(lambda: torch.cuda.Event().record(torch.cuda.current_stream(dev))))
    print("  threading.Event()        ", t(lambda: threading.Event()))
    print("  perf_counter             ", t(lambda: time.perf_counter()))
    print("  thread_time              ", t(lambda: time.thread_time()))
report("idle GPU")
# a long kernel queue plus another thread spinning in cudaEventSynchronize
stop = False
def spin():
    while not stop:
        e = torch.cuda.Event(); e.record(); e.synchronize()
for _ in range(50): a @ a
th = threading.Thread(target=spin); th.start()
report("busy GPU, another thread in Event.synchronize")
stop = True; th.join()
# GIL held by a Python thread
stop = False
def busy():
    while not stop: pass
th = threading.Thread(target=busy); th.start()
report("another thread busy in Python")
stop = True; th.join()
