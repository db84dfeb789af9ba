//! Turning fuzzer bytes into a configuration and operations.

use super::{HarnessConfig, Op, RecordOp};

/// Sizes worth trying for `cfg`: the edges around every threshold, then random ones.
pub fn edge_sizes(cfg: &HarnessConfig) -> Vec<u64> {
    let a = cfg.allocator;
    let t = a.suballoc_threshold;
    let r = a.region_size;
    let mut v = vec![
        0,
        1,
        a.chunk_size - 1,
        a.chunk_size,
        a.chunk_size + 1,
        t - 1,
        t,
        t + 1,
        r - 1,
        r,
        r + 1,
        u64::MAX,
        u64::MAX - a.align + 2,
        u64::MAX - 2 * a.align,
        (1 << 50) + 1,
    ];
    v.extend(
        cfg.limits
            .iter()
            .flatten()
            .flat_map(|&l| [l, l + 1, l - a.align]),
    );
    v
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn more(&self) -> bool {
        self.pos < self.data.len()
    }
}

/// Turn bytes into a configuration (first byte: small or default sizes, sub-allocation
/// on or off) and a sequence of operations.
pub fn decode(data: &[u8]) -> (HarnessConfig, Vec<Op>) {
    let mut c = Cursor { data, pos: 0 };
    let sel = c.u8();
    let mut cfg = if sel & 1 == 0 {
        HarnessConfig::small()
    } else {
        HarnessConfig::default_sizes()
    };
    cfg.allocator.suballoc = sel & 6 != 6; // off one time in four
    let edges = edge_sizes(&cfg);
    let a = cfg.allocator;
    let size = |c: &mut Cursor<'_>| -> u64 {
        let s = c.u8();
        let v = u64::from(c.u32());
        // Mostly sub-threshold sizes so pools grow several regions deep; some around the
        // threshold, some large, some edges.
        let t = a.suballoc_threshold;
        match s % 8 {
            0 => edges[v as usize % edges.len()],
            1..=3 => 1 + v % t,
            4 | 5 => 1 + v % (t / 8),
            6 => 1 + v % (t + t / 2),
            _ => 1 + v % (2 * a.region_size),
        }
    };
    let mut ops = Vec::new();
    while c.more() && ops.len() < 4096 {
        let op = match c.u8() % 16 {
            0..=6 => {
                // Half the traffic goes to device 0, context 0 so its pool grows several
                // regions deep; the rest spreads over every device and context.
                let b = c.u8();
                let (device, context) = if b & 0x80 == 0 { (0, 0) } else { (b, b >> 2) };
                Op::Allocate {
                    device,
                    context,
                    size: size(&mut c),
                }
            }
            7..=9 => Op::Free { pick: c.u32() },
            10 => Op::FreeUnknown {
                addr: u64::from(c.u32()) << 9,
            },
            11 => {
                let (kind, device, context) = (c.u8(), c.u8(), c.u8());
                let requested = size(&mut c) % (4 * a.region_size);
                let accounted = size(&mut c) % (a.region_size + 1);
                Op::Record(RecordOp {
                    kind,
                    device,
                    context,
                    requested,
                    accounted,
                    driver_ok: c.u8() % 4 != 0,
                })
            }
            12 => Op::ReleaseRecord { pick: c.u32() },
            13 => Op::Containing {
                pick: c.u32(),
                offset: u64::from(c.u32()),
            },
            14 => match c.u8() % 8 {
                0 => Op::DestroyContext { context: c.u8() },
                1 => Op::Trim,
                _ => Op::FailNextDeviceAllocation,
            },
            _ => Op::Free { pick: c.u32() },
        };
        ops.push(op);
    }
    (cfg, ops)
}
