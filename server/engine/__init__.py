"""The round engine: the lifecycle every algorithm shares, over Flower's ``Grid``.

``loop`` (the engine: wait for nodes, steps, evaluation, rows, checkpoints), ``algorithm`` (what an
algorithm implements), ``dispatcher`` (push messages, pull replies as they land), ``reply_screen``
(size checks before decoding) and ``update_guard`` (norm bound and weight cap of decoded updates).
"""
