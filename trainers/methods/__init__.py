"""The methods, one file each: its config dataclass and its `Method` subclass (trainers/method.py), registered by one
line in trainers/registry.py. What they share lives outside: trainers/comm.py (collectives), trainers/compression/,
trainers/optim.py."""
