/* Undefines the primitives an lm_simd_*.h header defines for lm_body.h (all
 * but LMV_LANE, the portable header's parameter), so that a translation
 * unit can include a second header, with other lanes, for its float64
 * kernels. */
#undef lmv_t
#undef LMV_W
#undef lmv_set1
#undef lmv_add
#undef lmv_sub
#undef lmv_mul
#undef lmv_div
#undef lmv_fma
#undef lmv_max
#undef lmv_min
#undef lmv_store
#undef lmv_abs
#undef lmv_copysign
#undef lmv_scale
#undef lmv_pow2q
#undef lmv_sel_n0
#undef lmv_zero_below
#undef lmv_loadu
#undef lmv_any_eq
#undef lmv_cnt_t
#undef lmv_cnt_zero
#undef lmv_cnt_gt
#undef lmv_cnt_sum
#undef lmv_acc_t
#undef lmv_acc_fma
#undef lmv_acc_sum
#undef lmv_wide_t
#undef lmv_wide_zero
#undef lmv_wide_add
#undef lmv_wide_sum
#undef LM_QBITS
#undef LM_LOAD2_F32
#undef LM_LANE_F32
#undef LM_LOAD2_F16
#undef LM_LANE_F16
#undef LM_LOAD2_BF16
#undef LM_LANE_BF16
#undef LM_LOAD2_F64
#undef LM_LANE_F64
