import time
from timerwheel import runtime
orig = runtime.StageRunner.run
cpu = {}
def run(self):
    try: orig(self)
    finally: cpu[self.name] = time.thread_time()
runtime.StageRunner.run = run
from bench.bench_embedded import throughput
throughput(100000)
print({k: round(v,2) for k,v in cpu.items()})
