"""Run any fedistill algorithm on Flower (``pip install 'fedistill[flower]'``, flwr 1.41).

- :mod:`.app`: ``server_app`` and ``client_app``, the Flower ServerApp and ClientApp;
- :mod:`.records`: Message <-> RecordDict and the client state in ``context.state``;
- :mod:`.settings`: the run-config keys (configuration, round timeout, minimum replies, resume);
- :mod:`.project`: ``write_app`` writes the app directory that ``flwr run`` submits;
- :mod:`.local`: ``LocalFederation``, a SuperLink and N SuperNodes as local subprocesses;
- :mod:`.worker`: ``python -m fedistill.flower clientapp``, a long-running ClientApp next to a SuperNode
  started with ``--isolation process`` (imports and the client's data once, not per message);
- :mod:`.supernode`: ``python -m fedistill.flower supernode``, flower-supernode polling faster during a run.

``python -m fedistill.flower app --config X.yaml --out DIR`` writes an app directory (docs/flower.md, "Running
across machines").
Importing this package does not import flwr; its submodules do.
"""
