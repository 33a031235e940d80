"""collectives: collective communication for data-parallel training.

The numpy module: ClusterSpec, Communication and the packer. `import collectives.torch`
registers the torch.distributed backend "collectives".
"""
