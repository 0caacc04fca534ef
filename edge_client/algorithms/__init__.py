"""The device side of each round algorithm, one module each, found by ``fedge.edge_client.app``.

A module named after an algorithm defines ``train(msg, context)``; the ClientApp registers it for
that algorithm's train messages (``fedavg``: Flower's plain ``train``; any other: ``train.<name>``,
Flower's named action). A module may also define ``evaluate(msg, context)`` for evaluate messages
(FedAvg's federated evaluation). Adding an algorithm's device side is adding its module here.
"""
