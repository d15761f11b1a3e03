"""The fault campaign: real processes on loopback, a nemesis that injects faults, and a checker that reads
the recorded history (``python -m faults``; docs/faults.md).

| module | what it does |
|---|---|
| `history.py` | the records every party writes (JSON lines) and reading a run's directory back |
| `checker.py` | pure: a run's history -> its violations and its table cells (no I/O, no clock) |
| `report.py` | the table (fault x layout), printed and written into docs/faults.md |
| `plan.py` | pure: a seeded fault plan (episodes of one fault, or two overlapping), saved to replay a run |
| `nemesis.py` | carries a plan out against a cluster, recording every fault window and process state |
| `cluster.py` | the processes: redis-server (AOF), three proxies, their upstream(s), the balancer |
| `balancer.py` | a round-robin TCP balancer with no affinity that can cut every client connection at once |
| `upstream.py` | the campaign's upstream (official SDK): ``work`` runs with progress, each run logged |
| `client.py` | a client of the official Python SDK running tool calls with progress, its history recorded |
| `client.mjs` | the same client on the official TypeScript SDK (installed at run time, outside the repo) |
| `tsclient.py` | installing and finding the TypeScript client's packages |
| `campaign.py` | one layout's run: start everything, run the plan, heal, stop, check |
"""
