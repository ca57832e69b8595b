"""The chaos harness (issue 14): real ``delayq worker`` processes against throwaway servers behind a TCP
fault proxy, faults on a seeded schedule, a recorded history and a checker over it.

Run ``python -m tests.chaos --backend postgresql --profile ci --seed 1`` from the repository root; see
docs/reliability.md. Modules: :mod:`.servers` (throwaway servers), :mod:`.app` (the handlers the workers
run), :mod:`.history` (recording and the checker), :mod:`.harness` (profiles, schedule, the run).
"""
