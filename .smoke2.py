import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
exec(open('.smoke.py').read().split('r = run')[0])
from tests.equivalence import train_and_collect
r = train_and_collect([MOE], 3)
print(r[0]["losses"], r[0]["grad_norm"], r[0]["aux"])
