"""The `kvpush` command line: parsing, rendering and exit codes only; the work lives in kvpush.deploy."""
