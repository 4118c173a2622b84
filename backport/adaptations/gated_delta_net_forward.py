# Downstream adaptation template of the gdn-backport recipe (our code, not upstream's).
# The transform `gdn_linear_cp_forward` parses this file with libcst and puts the function
# below in place of `GatedDeltaNet.forward` in megatron/core/ssm/gated_delta_net.py.
# It is never imported from here: names resolve in gated_delta_net.py's namespace.
# ruff: noqa


def forward(
    self,
    hidden_states: Tensor,
    attention_mask: Tensor,
    inference_context: Optional[BaseInferenceContext] = None,
    packed_seq_params: Optional[PackedSeqParams] = None,
    sequence_len_offset: Optional[int] = None,
    *,
    inference_params: Optional[BaseInferenceContext] = None,
    **kwargs,
):
    """Run GDN on this rank's sequence shard under the layer's static ``linear_cp_mode``.

    Args:
        hidden_states (Tensor): ``[s_local, b, hidden]`` (THD: ``[t_local, 1, hidden]``), this
            CP rank's zigzag shard; divided by TP under sequence parallelism.
        attention_mask (Tensor): unused by GDN.
        inference_context (Optional[BaseInferenceContext]): not supported by GDN.
        packed_seq_params (Optional[PackedSeqParams]): THD metadata with global cu_seqlens;
            its ``cp_group``/``local_cp_size`` select the CP group of a dynamic-CP micro-batch.
        sequence_len_offset (Optional[int]): unused.

    Returns:
        (Tensor, Tensor): output ``[s_local, b, hidden]`` in the input's layout, and bias.

    Raises:
        LinearCPError: unsupported CP input (see ``gdn_context_parallel``), raised before
            any collective.
    """
    inference_context = deprecate_inference_params(inference_context, inference_params)

    local_seq_len, batch, _ = hidden_states.shape
    plan = gdn_context_parallel.plan_linear_cp(
        self.config.linear_cp_mode,
        self.pg_collection.cp,
        packed_seq_params,
        local_seq_len=local_seq_len,
        batch=batch,
        sp_size=self.sp_size,
        deterministic_mode=self.config.deterministic_mode,
        has_inference_context=inference_context is not None,
        num_key_heads=self.num_key_heads,
        num_value_heads=self.num_value_heads,
        tp_size=self.tp_size,
    )
    # Heads are split over CP only on the headwise path; the other paths keep all TP heads.
    cp_size_headwise = plan.size if plan.headwise else 1
    cp_group_headwise = plan.group if plan.headwise else None

    if inference_context is not None:
        assert (
            inference_context.is_static_batching()
        ), "GDN does not currently support dynamic inference batching."
        assert not self.config.sequence_parallel
        raise NotImplementedError("GDN does not support inference for now.")

    is_thd = packed_seq_params is not None and packed_seq_params.qkv_format == 'thd'
    packed_metadata = None
    cu_seqlens_q = None
    cu_seqlens_q_cpu = None
    if is_thd:
        assert batch == 1, "Packed sequence expects batch dimension to be 1"
        assert (
            not self.config.deterministic_mode
        ), "Packed sequence does not support deterministic mode."
        # The micro-batch's metadata, built once by finalize_packed_seq_params in the data path
        # (else by the first GDN layer): global cu_seqlens checked on their host copy, without
        # empty segments (FLA 0.4.2 would assign them to the wrong sequence), on a device tensor
        # of its own (FLA caches on tensor identity), with the CP routes and FLA's CP context.
        packed_metadata = gdn_context_parallel.packed_seq_metadata(
            packed_seq_params, plan.global_seq_len, plan.group
        )
        cu_seqlens_q = packed_metadata.cu_seqlens
        cu_seqlens_q_cpu = packed_metadata.cu_seqlens_cpu
    gdn_context_parallel.check_sequence_lengths(plan, cu_seqlens_q_cpu, self.conv_kernel_dim)
    gdn_context_parallel.check_kernel_extent(
        plan,
        batch,
        conv_channels=self.conv_dim_local_tp // cp_size_headwise,
        scan_heads=self.num_value_heads // self.tp_size // cp_size_headwise,
        key_head_dim=self.key_head_dim,
        value_head_dim=self.value_head_dim,
    )

    # Kernel-side sequence metadata: global cu_seqlens (and their host copy, so that FLA needs
    # no device sync), plus FLA's CP context on chunkwise.
    kernel_cu_seqlens = cu_seqlens_q
    kernel_cu_seqlens_cpu = cu_seqlens_q_cpu
    chunkwise_cp_context = None
    thd_layout = None
    if plan.chunkwise and packed_metadata is not None:
        chunkwise_cp_context = packed_metadata.fla_cp_context(self.conv_kernel_dim)
        # Both layout conversions routed once per micro-batch on the host copy (upstream
        # derives the route from device cu_seqlens at every conversion, syncing each time).
        thd_layout = packed_metadata.layout_route()
    elif plan.chunkwise:
        kernel_cu_seqlens_cpu = torch.arange(batch + 1, dtype=torch.int32) * plan.global_seq_len
        kernel_cu_seqlens = gdn_context_parallel.host_to_device(
            kernel_cu_seqlens_cpu, hidden_states.device
        )
        chunkwise_cp_context = build_cp_context(
            cu_seqlens=kernel_cu_seqlens,
            group=plan.group,
            conv1d_kernel_size=self.conv_kernel_dim,
            cu_seqlens_cpu=kernel_cu_seqlens_cpu,
        )
    gather_index = (None, None)
    if plan.all_gather and packed_metadata is not None:
        gather_index = packed_metadata.gather_index()
    # FLA's kernels take the host copy beside cu_seqlens (the deterministic torch path never
    # gets packed input).
    kernel_kwargs = (
        {} if kernel_cu_seqlens_cpu is None else {"cu_seqlens_cpu": kernel_cu_seqlens_cpu}
    )

    head_split_sections = [
        self.qk_dim_local_tp,
        self.qk_dim_local_tp,
        self.v_dim_local_tp,
        self.v_dim_local_tp,
        self.num_value_heads // self.tp_size,
        self.num_value_heads // self.tp_size,
    ]
    # Chunkwise converts zigzag <-> contiguous on the narrower side of each projection:
    # in_proj and out_proj act on every token alone, so the token permutation commutes with
    # them. Under sequence parallelism the projections also move the sequence over TP, so
    # the conversion stays on the projection outputs there.
    layout_before_in_proj = (
        plan.chunkwise
        and self.sp_size == 1
        and hidden_states.shape[-1] < sum(head_split_sections)
    )
    layout_after_out_proj = (
        plan.chunkwise and self.sp_size == 1 and hidden_states.shape[-1] < self.v_dim_local_tp
    )
    if layout_before_in_proj:
        nvtx_range_push(suffix="zigzag_to_contiguous")
        hidden_states = (
            thd_layout.to_contiguous(hidden_states)
            if thd_layout is not None
            else zigzag_to_contiguous_chunks(hidden_states, plan.group, seq_dim=0)
        )
        nvtx_range_pop(suffix="zigzag_to_contiguous")

    # Input projection
    nvtx_range_push(suffix="in_proj")
    qkvzba, _ = self.in_proj(hidden_states)
    nvtx_range_pop(suffix="in_proj")
    seq_len = local_seq_len * self.sp_size

    if plan.chunkwise and not layout_before_in_proj:
        # Zigzag shard -> contiguous time chunk (rank r holds chunks 2r, 2r+1).
        nvtx_range_push(suffix="zigzag_to_contiguous")
        qkvzba = (
            thd_layout.to_contiguous(qkvzba)
            if thd_layout is not None
            else zigzag_to_contiguous_chunks(qkvzba, plan.group, seq_dim=0)
        )
        nvtx_range_pop(suffix="zigzag_to_contiguous")
    elif plan.all_gather:
        nvtx_range_push(suffix="all_gather_sequence")
        qkvzba = gdn_context_parallel.gather_zigzag_sequence(
            qkvzba,
            plan.group,
            seq_dim=0,
            cu_seqlens=cu_seqlens_q_cpu,
            natural_index=gather_index[0],
        )
        nvtx_range_pop(suffix="all_gather_sequence")
        seq_len = seq_len * plan.size
    elif plan.headwise:
        if is_thd:
            outputs = []
            for qkvzba_i in _unpack_sequence(qkvzba, cu_seqlens_q_cpu // plan.size, dim=0):
                outputs.append(
                    tensor_a2a_cp2hp(
                        qkvzba_i,
                        seq_dim=0,
                        head_dim=-1,
                        cp_group=cp_group_headwise,
                        split_sections=head_split_sections,
                    )
                )
            qkvzba = torch.cat(outputs, dim=0)
        else:
            qkvzba = tensor_a2a_cp2hp(
                qkvzba,
                seq_dim=0,
                head_dim=-1,
                cp_group=cp_group_headwise,
                split_sections=head_split_sections,
            )
        seq_len = seq_len * plan.size

    # Transpose: s b x --> b s x
    qkvzba = qkvzba.transpose(0, 1)

    # Split into qkv, gate, beta, alpha (heads divided by CP on the headwise path only)
    qkv, gate, beta, alpha = torch.split(
        qkvzba,
        [
            (self.qk_dim_local_tp * 2 + self.v_dim_local_tp) // cp_size_headwise,
            self.v_dim_local_tp // cp_size_headwise,
            self.num_value_heads // self.tp_size // cp_size_headwise,
            self.num_value_heads // self.tp_size // cp_size_headwise,
        ],
        dim=-1,
    )
    gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
    beta = beta.reshape(batch, seq_len, -1)
    alpha = alpha.reshape(batch, seq_len, -1)

    # Convolution on qkv
    nvtx_range_push(suffix="conv1d")
    assert (
        qkv.shape[1] == seq_len
    ), f"GDN conv input has {qkv.shape[1]} tokens, expected {seq_len}"
    qkv_channels_split_sections = [
        self.qk_dim_local_tp,
        self.qk_dim_local_tp,
        self.v_dim_local_tp,
    ]
    conv1d_weight = get_parameter_local_cp(
        self.conv1d.weight,
        dim=0,
        cp_group=cp_group_headwise,
        split_sections=qkv_channels_split_sections,
    )
    conv1d_bias = (
        get_parameter_local_cp(
            self.conv1d.bias,
            dim=0,
            cp_group=cp_group_headwise,
            split_sections=qkv_channels_split_sections,
        )
        if self.conv_bias
        else None
    )
    if self.config.deterministic_mode:
        qkv = qkv.transpose(1, 2).contiguous()  # b, s, d -> b, d, s
        conv_out = F.conv1d(
            input=qkv,
            weight=conv1d_weight,
            bias=conv1d_bias,
            stride=self.conv1d.stride,
            padding=self.conv1d.padding,
            dilation=self.conv1d.dilation,
            groups=self.conv_dim_local_tp // cp_size_headwise,
        )
        qkv = self.act_fn(conv_out[..., :seq_len])
        qkv = qkv.transpose(1, 2)  # b, d, s -> b, s, d
    else:
        assert self.activation in ["silu", "swish"]
        conv_kwargs = {"cp_context": chunkwise_cp_context} if plan.chunkwise else kernel_kwargs
        # FLA's conv reads x through its strides, so the split view needs no copy.
        qkv, _ = causal_conv1d(
            x=qkv,
            weight=conv1d_weight.squeeze(1),  # d, 1, w -> d, w
            bias=conv1d_bias,
            activation=self.activation,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=kernel_cu_seqlens,
            **conv_kwargs,
        )
    nvtx_range_pop(suffix="conv1d")

    # Split, reshape, L2 norm, repeat_interleave, contiguous
    nvtx_range_push(suffix="prepare_qkv_for_gated_delta_rule")
    query, key, value, gate, beta, alpha = self._prepare_qkv_for_gated_delta_rule(
        qkv, gate, beta, alpha, batch, seq_len, cp_size_headwise
    )
    nvtx_range_pop(suffix="prepare_qkv_for_gated_delta_rule")

    # Calculate g and beta
    nvtx_range_push(suffix="g_and_beta")
    A_log_local_cp = get_parameter_local_cp(self.A_log, dim=0, cp_group=cp_group_headwise)
    dt_bias_local_cp = get_parameter_local_cp(self.dt_bias, dim=0, cp_group=cp_group_headwise)
    g, beta = self._compute_g_and_beta(A_log_local_cp, dt_bias_local_cp, alpha, beta)
    nvtx_range_pop(suffix="g_and_beta")

    nvtx_range_push(suffix="gated_delta_rule")
    rule_kwargs = {"cp_context": chunkwise_cp_context} if plan.chunkwise else kernel_kwargs
    core_attn_out, last_recurrent_state = self.gated_delta_rule(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=kernel_cu_seqlens,
        **rule_kwargs,
    )
    nvtx_range_pop(suffix="gated_delta_rule")

    # RMSNorm
    nvtx_range_push(suffix="gated_norm")
    norm_out = self._apply_gated_norm(core_attn_out, gate)
    nvtx_range_pop(suffix="gated_norm")

    # Transpose: b s x --> s b x
    norm_out = norm_out.reshape(batch, seq_len, -1)
    norm_out = norm_out.transpose(0, 1).contiguous()

    # Back to this rank's zigzag sequence shard
    if plan.chunkwise and not layout_after_out_proj:
        nvtx_range_push(suffix="contiguous_to_zigzag")
        norm_out = (
            thd_layout.to_zigzag(norm_out)
            if thd_layout is not None
            else contiguous_to_zigzag_chunks(norm_out, plan.group, seq_dim=0)
        )
        nvtx_range_pop(suffix="contiguous_to_zigzag")
    elif plan.all_gather:
        norm_out = gdn_context_parallel.scatter_zigzag_sequence(
            norm_out,
            plan.group,
            seq_dim=0,
            cu_seqlens=cu_seqlens_q_cpu,
            local_order=gather_index[1],
        )
    elif plan.headwise:
        if is_thd:
            outputs = []
            for norm_out_i in _unpack_sequence(norm_out, cu_seqlens_q_cpu, dim=0):
                outputs.append(
                    tensor_a2a_hp2cp(
                        norm_out_i, seq_dim=0, head_dim=-1, cp_group=cp_group_headwise
                    )
                )
            norm_out = torch.cat(outputs, dim=0)
        else:
            norm_out = tensor_a2a_hp2cp(
                norm_out, seq_dim=0, head_dim=-1, cp_group=cp_group_headwise
            )

    # Output projection
    nvtx_range_push(suffix="out_proj")
    out, out_bias = self.out_proj(norm_out)
    nvtx_range_pop(suffix="out_proj")

    if layout_after_out_proj:
        nvtx_range_push(suffix="contiguous_to_zigzag")
        out = (
            thd_layout.to_zigzag(out)
            if thd_layout is not None
            else contiguous_to_zigzag_chunks(out, plan.group, seq_dim=0)
        )
        nvtx_range_pop(suffix="contiguous_to_zigzag")

    return out, out_bias
