//! Cache prefetch hints, so that independent misses (many blocks registered or allocated in
//! one step) overlap. A hint never faults and changes nothing observable; elsewhere than
//! x86-64 it is a no-op.

#[inline(always)]
pub fn read(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint: it never faults and reads nothing into the program.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
