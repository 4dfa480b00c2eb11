"""What every benchmark shares: the command line (:mod:`.cli`), the report (:mod:`.report`), the docs
updater (:mod:`.docs`), the counters and spawned ranks (:mod:`.measure`), the workloads
(:mod:`.workloads`) and the implementations compared (:mod:`.impls`)."""
