"""What the engines' checkpoints are on disk (layer 1): each checkpoint's own description and offline readers
(meta.py), loading files without running code from them (safe_load.py), resuming one backend's or layout's
checkpoint on another (portable.py), and the Hugging Face export (hf_export.py)."""
