"""``esi-sidecar demo``: the whole story on an emulated ESI release (see ``run``).

``run`` drives the story, ``trainer`` is the training process it starts, ``toy_model``
the model both it and ``examples/plain_pytorch.py`` train.
"""
