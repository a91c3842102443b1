"""How a run stops: a signal (``preemption``), a rank gone (``dead_rank``, with the process-group timeout),
the ranks Lightning's launcher starts ending with it (``launched_ranks``)."""
