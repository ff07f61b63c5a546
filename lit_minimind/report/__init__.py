"""The pipeline's evaluation and report card (``python -m lit_minimind.report evaluate|card RUN_DIR``), which
``python -m lit_minimind.pipeline`` runs as its last two steps: :mod:`.evaluate`, :mod:`.card`."""
