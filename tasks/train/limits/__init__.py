"""What bounds a training job while it runs: the time limit and its requeue, signals during
start-up, and ranks slower than the others.

Modules:
    time_limit         the time-limit watch: measured times, rank 0's plan, its broadcast.
    limit_requeue      checkpoint where the watch stops, requeue; attempts without progress.
    early_signal       a requeue signal that arrives while a rank starts is held, not fatal.
    step_times         each rank's steps split into data wait, compute and communication.
    stragglers         a rank persistently slower than the others, named on rank 0.
"""
