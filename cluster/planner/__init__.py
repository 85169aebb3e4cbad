"""The capacity planner: `pdserve profile` (measure a replica: `measure`, into the format of `profile`)
and `pdserve plan` (a workload and its objectives, `workload`, simulated on a budget of replicas with
the code's own policies, `simulator`, searched for the best split and chunk size, `search`, printed
and plotted, `report` and `plot`)."""
