"""Tools around the cloudtrain library: the `cloudtrain` subcommands and what they run.

- `netem`: the local WAN emulator (network namespaces, tbf, a userspace delay line; needs root);
- `bench`: DDP, its hooks and CloudDDP side by side on the emulated WAN (`make demo`);
- `hosts`, `launch`: the cluster's hosts from Terraform or EC2, and horovodrun on them (boto3);
- `probe`: the `cloudtrain probe` command over cloudtrain.probe;
- `data`: the small real data sets and models the examples and the benchmark train.

Tools import the core (cloudtrain.*); the core never imports a tool, so `import cloudtrain`
needs neither boto3 nor root.
"""
