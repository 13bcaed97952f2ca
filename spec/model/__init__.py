"""The formal model, in the order to read it: the words for a node's lifecycle
(:mod:`.lifecycle`), one node's lifecycle as a ``transitions`` machine
(:mod:`.machine`), and the safety properties (:mod:`.invariants`) that the
checker and the simulator hold every state and step to."""
