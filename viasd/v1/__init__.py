"""Generated gRPC stubs of the via-sd API (package viasd.v1): regenerate with scripts/gen_protos.sh, never edit."""
