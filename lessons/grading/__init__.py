"""The grader of ``lessons/exercises``: run ``python -m lessons.grade NN`` from the repository root.

``runner`` loads a learner's file, says "not written yet" for stubs, runs the
exercise's check at every world size (``sizes``: 3, 2, 4 and 1 ranks of one
pool) and turns crashes and hangs into sentences; ``ledger`` matches every
collective across ranks before Gloo runs it (a lone, mismatched or
abandoned call is named at once, with the learner's line); ``bench`` is the
lessons' test bench seen from the grader (one process on the whole batch as
the reference), ``models`` the family of models exercises 04-07 also train,
``memory`` what a learner's objects reach; one ``check_*`` module per family
of exercises.
"""
