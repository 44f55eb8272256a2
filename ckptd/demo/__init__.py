"""``ckptd demo``: the elastic demo — a simulated cluster of torchrun nodes on 127.0.0.1, each
with its ckptd node agent (:mod:`.cluster`), and the demo's timeline and its exactly-once check
(:mod:`.timeline`). Not part of the library: nothing in ``ckptd`` but the command imports it."""
