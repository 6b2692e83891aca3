"""``lanes chaos``: break a local system five ways under load and count what was lost.

``run`` is the command, ``rig`` the processes it breaks (on the shared process harness,
``cli/cluster.py``), ``faults`` the faults themselves, ``load`` the clients and their ledger.
"""
