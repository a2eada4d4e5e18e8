"""Communication: the collectives the front ends call, the per-backend plans, the shared-memory transport and
its pipe barrier, and the collective watch. Front ends say what to gather or scatter; this package picks how."""
