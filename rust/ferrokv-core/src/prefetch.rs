//! Memory hints. Prefetch: so that independent misses (many blocks registered or allocated in
//! one step) overlap; a hint never faults and changes nothing observable; elsewhere than
//! x86-64 it is a no-op. Prefault: buffers that will be written a little at a time over many
//! steps (the prefix cache's token arena, a sequence's token list) get their pages mapped up
//! front, so that no decode step pays for a page fault (a few µs each on a VM).

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

/// Hints every cache line of `len` bytes from `p` (a struct that spans several lines).
#[inline(always)]
pub fn read_range(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        read(p.wrapping_add(off));
        off += 64;
    }
    if len > 0 {
        read(p.wrapping_add(len - 1)); // the last line, when `p` is not line-aligned
    }
}

/// `read_range` over a value.
#[inline(always)]
pub fn read_value<T>(v: &T) {
    read_range(v as *const T as *const u8, std::mem::size_of::<T>());
}

const PAGE: usize = 4096;

/// Writes `value` once per page of `v`, so that every page is mapped now.
fn touch_pages<T: Copy>(v: &mut [T], value: T) {
    for x in v.iter_mut().step_by(PAGE / std::mem::size_of::<T>().max(1)) {
        // SAFETY: a valid, aligned, exclusive reference. Volatile: a write the program never
        // reads (or a zero over a zero) must not be elided, its side effect (the mapping) is
        // the point.
        unsafe { std::ptr::write_volatile(x, value) };
    }
}

/// Maps every page of a freshly zeroed buffer now (keeping the zeros), so that the first use
/// of each page later does not pay for a page fault.
pub fn prefault_zeroed(v: &mut [u32]) {
    touch_pages(v, 0);
}

/// Maps the pages of a list's reserved but unused capacity, at most `max_bytes` of it (see
/// `prefault_zeroed`). The bound keeps a huge reservation (a long `max_tokens` that may never
/// be used) from costing its whole size up front.
pub fn prefault_spare(v: &mut Vec<u32>, max_bytes: usize) {
    let spare = v.spare_capacity_mut();
    let len = spare.len().min(max_bytes / std::mem::size_of::<u32>());
    // Any value may be written to uninitialized capacity.
    touch_pages(&mut spare[..len], std::mem::MaybeUninit::new(0));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefaulting_changes_no_value_and_no_length() {
        let mut v = vec![0u32; 3 * PAGE];
        prefault_zeroed(&mut v);
        assert!(v.iter().all(|&x| x == 0));
        let mut t: Vec<u32> = Vec::with_capacity(5000);
        t.extend([1, 2, 3]);
        prefault_spare(&mut t, usize::MAX);
        prefault_spare(&mut t, 100);
        assert_eq!((t.len(), &t[..]), (3, &[1, 2, 3][..]));
        assert!(t.capacity() >= 5000);
        let mut full = vec![7u32; 4];
        prefault_spare(&mut full, usize::MAX); // no spare capacity: nothing to do
        assert_eq!(full, [7; 4]);
        read_value(&full);
        read_range(full.as_ptr() as *const u8, 16);
        read_range(full.as_ptr() as *const u8, 0); // nothing to fetch, and no underflow
    }
}
