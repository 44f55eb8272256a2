"""The node agent: a process per node that owns the staging memory and writes and commits the
saves its trainers staged there, so that a save outlives the training process
(``docs/agent.md``).

The process: :mod:`.server` (the agent), :mod:`.session` (one trainer's connection), :mod:`.core`
(what its parts use of it), :mod:`.upkeep` (memory of unused roots, idle exit, status),
:mod:`.holdings` (what it holds, under its budget and the node's reserves: :mod:`.node_memory`),
:mod:`.shm` (the shared memory), :mod:`.gate` (a save's pace and stop), :mod:`.handoff` and
:mod:`.orphans` (SIGTERM and restarts). Its peers: :mod:`.peer_wire` (the authenticated wire and
server), :mod:`.replication` (what goes to whom), :mod:`.peer_service` (its side facing them).
The trainer's side: :mod:`.launch` (whether to use an agent, getting one), :mod:`.client` (the
connection), :mod:`.executor` (the Saver's executor), :mod:`.jobs` (a save job's wire form),
:mod:`.load_tier` (a load's view of every agent's memory). :mod:`.wire`: the socket, its
messages, who may use it.
"""
