"""The grader of ``lessons/exercises``: run ``python -m lessons.grade NN`` from the repository root.

``runner`` loads a learner's file, says "not written yet" for stubs, runs the
exercise's check on Gloo ranks and turns crashes and hangs into sentences;
``bench`` is the lessons' test bench seen from the grader (one process on the
whole batch as the reference); one ``check_*`` module per family of exercises.
"""
