"""Generated protobuf code (never edited by hand): `make proto` regenerates it from `proto/`."""
