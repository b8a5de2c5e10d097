"""`python -m kernels_cpu`: are this install's CPU kernels usable, and if not, why not."""
from kernels_cpu.library import library_path, unavailable_reason

reason = unavailable_reason()
print(f"CPU attention kernels: {reason or f'ready ({library_path()})'}")
raise SystemExit(1 if reason else 0)
