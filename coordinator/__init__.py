"""The coordinator's core and its layers, shared by Fedge's engine and ``fedge.flower``.

The core: a step (``step``), its reply tally (``tally``), the door every reply goes through
(``door``), the message dispatcher and the asynchronous schedule (``dispatcher``, ``async_loop``),
the layer interface and how layers compose (``layer``), and a Flower app's reply reading
(``app_reply``). The layers a round can carry, each usable by both coordinators: device selection
(``selection_layer``: uniform, or Oort), the update guard (``update_guard``), the downlink
(``downlink_layer``), differential privacy (``dp_layer``, one layer over the mechanisms of
``dp_mechanisms``: central Gaussian, a leaf's clip, a root's noise, distributed Skellam), the model average
(``model_average_layer``), a leaf's root-round stamp (``root_round_layer``), secure aggregation (``secure_layer`` with ``secure_round`` and
``secure_session``), EASGD's center step
(``elastic_layer``), FedNova's normalisation (``fednova_layer``) and SCAFFOLD's control variates
(``scaffold_layer``). The wire these speak (records, config keys, refusals) is ``fedge.protocol``; which layers a run of
Fedge's engine builds from its settings, and what they refuse together, is ``fedge.server.engine.layers``.
"""
