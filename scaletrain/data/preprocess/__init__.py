"""Preprocessing scripts writing parquet files in verl's RL row format (``python -m scaletrain.data.preprocess.X``)."""
