"""The fault-tolerance core: what happens when a rank dies, hangs or comes back.

The store and the job's membership, the commit ledger, liveness, unblocking a stuck collective,
the one layout transaction, recovery and rejoin, the launcher. It sits between the runtime's parts
(distributed set-up, resharding, transport) and the training loop, and reaches the trainer only
through ``protocol.TrainerLike``. See docs/fault_tolerance.md.
"""
