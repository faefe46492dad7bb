"""What a step's sampling rank returns: tokens drawn from the logits after the logits
processors and grammar masks, with their logprobs."""
