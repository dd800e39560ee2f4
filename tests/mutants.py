"""Deliberately wrong versions of xtokspec's samplers, for the negative controls (each must fail the check the
right one passes). Handed to the verifier through `decode.verify.SamplerOps` (XTokSpec.sampler_ops), or called
directly where a test runs the verifier's function itself."""

from __future__ import annotations


def unnormalised_walk(at_root: bool = True, below: bool = True):
    """WRONG: tree.walk_sampled without the renormalisation of the recursive rejection (a later child c_j is
    accepted with p(c_j) instead of p(c_j) / (1 - the rejected children's mass)) at the root's children
    (`at_root`) and/or at the nodes below it (`below`). The same loop as tree.walk_sampled, one line changed."""

    def flawed(trie, p_children, uniforms, root_tests=None):
        node, path = 0, []
        while True:
            flaw = at_root if node == 0 else below
            remaining, accepted = 1.0, None
            for j, child in enumerate(trie.children[node]):
                if node == 0 and root_tests is not None:
                    p_j, q_j = root_tests[j]
                    if uniforms[0][j] * q_j < p_j:
                        accepted = child
                        break
                    continue
                if uniforms[node][j] * (1.0 if flaw else remaining) < p_children[node][j]:
                    accepted = child
                    break
                remaining -= p_children[node][j]
            if accepted is None:
                return path, node
            path.append(accepted)
            node = accepted

    return flawed
