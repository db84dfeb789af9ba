//! A small GPU scheduler embedding `vgpu-alloc-core`: tenants with per-device memory
//! quotas share a node of several GPUs; each request is admitted or refused (and says
//! why), finished jobs give their memory back, and a summary shows who holds what.
//!
//! `cargo run -p vgpu-alloc-core --example scheduler` prints a session;
//! `cargo test -p vgpu-alloc-core --example scheduler` runs its tests.
//!
//! The admission decision is two [`Reservation`]s: one in the tenant's ledger (its quota)
//! and one in the node's (the physical memory of each GPU). Both are atomic against
//! concurrent admissions; when the node refuses, dropping the tenant's reservation gives
//! its quota back, so a refusal never leaves a charge behind.

use std::collections::BTreeMap;
use std::fmt;

use vgpu_alloc_core::{
    DeviceIndex, InMemoryLedger, OutOfMemory, Reservation, UsageClass, UsageLedger,
};

const GIB: u64 = 1 << 30;

/// A job admitted on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct JobId(u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "job {}", self.0)
    }
}

#[derive(Debug)]
struct Job {
    tenant: usize,
    device: DeviceIndex,
    bytes: u64,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The tenant's quota on that device does not leave room.
    Quota(OutOfMemory),
    /// The GPU itself is full (other tenants hold the rest).
    Capacity(OutOfMemory),
    /// No device has room for it, within quota and capacity.
    NowhereFits,
    /// No such tenant or device.
    Unknown,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Quota(oom) => write!(f, "over quota: {oom}"),
            Self::Capacity(oom) => write!(f, "GPU full: {oom}"),
            Self::NowhereFits => write!(f, "no device has room"),
            Self::Unknown => write!(f, "unknown tenant or device"),
        }
    }
}

struct Tenant {
    name: &'static str,
    /// Its quota per device (`Some(0)`: not allowed on that device).
    quota: InMemoryLedger,
}

/// Admission decisions for every tenant on every GPU of one node.
struct Scheduler {
    /// Physical memory of each GPU: the limit no admission set may exceed together.
    node: InMemoryLedger,
    tenants: Vec<Tenant>,
    jobs: BTreeMap<JobId, Job>,
    next: u64,
    admitted: u64,
    refused: u64,
}

impl Scheduler {
    /// A node whose GPU `i` has `capacity[i]` bytes.
    fn new(capacity: &[u64]) -> Self {
        Self {
            node: InMemoryLedger::new(capacity.iter().map(|&c| Some(c))),
            tenants: Vec::new(),
            jobs: BTreeMap::new(),
            next: 1,
            admitted: 0,
            refused: 0,
        }
    }

    /// Add a tenant with a quota per GPU (`None`: only the GPU's capacity limits it).
    fn tenant(&mut self, name: &'static str, quota: &[Option<u64>]) -> usize {
        assert_eq!(quota.len(), self.node.devices(), "one quota per GPU");
        self.tenants.push(Tenant {
            name,
            quota: InMemoryLedger::new(quota.iter().copied()),
        });
        self.tenants.len() - 1
    }

    /// Admit `bytes` for `tenant` on `device`, or say why not.
    fn request(
        &mut self,
        tenant: usize,
        device: DeviceIndex,
        bytes: u64,
    ) -> Result<JobId, Refusal> {
        let decision = self.admit(tenant, device, bytes);
        match decision {
            Ok(_) => self.admitted += 1,
            Err(_) => self.refused += 1,
        }
        decision
    }

    fn admit(&mut self, tenant: usize, device: DeviceIndex, bytes: u64) -> Result<JobId, Refusal> {
        let t = self.tenants.get(tenant).ok_or(Refusal::Unknown)?;
        if !self.node.has_device(device) {
            return Err(Refusal::Unknown);
        }
        let quota =
            Reservation::new(&t.quota, device, UsageClass::Data, bytes).map_err(Refusal::Quota)?;
        // On refusal `quota` is dropped here, which releases the tenant's bytes again.
        let capacity = Reservation::new(&self.node, device, UsageClass::Data, bytes)
            .map_err(Refusal::Capacity)?;
        quota.commit();
        capacity.commit();
        let id = JobId(self.next);
        self.next += 1;
        self.jobs.insert(
            id,
            Job {
                tenant,
                device,
                bytes,
            },
        );
        Ok(id)
    }

    /// Admit `bytes` for `tenant` on the GPU with the most room left, trying the others
    /// in turn when the quota or the GPU refuses.
    fn place(&mut self, tenant: usize, bytes: u64) -> Result<(DeviceIndex, JobId), Refusal> {
        let mut devices: Vec<DeviceIndex> =
            (0..self.node.devices() as u32).map(DeviceIndex).collect();
        devices.sort_by_key(|&d| {
            let u = self.node.usage(d);
            std::cmp::Reverse(u.limit.unwrap_or(u64::MAX).saturating_sub(u.used))
        });
        for d in devices {
            if let Ok(id) = self.admit(tenant, d, bytes) {
                self.admitted += 1;
                return Ok((d, id));
            }
        }
        self.refused += 1;
        Err(Refusal::NowhereFits)
    }

    /// The job is done: its memory goes back to its tenant and its GPU.
    fn finish(&mut self, id: JobId) -> bool {
        let Some(job) = self.jobs.remove(&id) else {
            return false;
        };
        let t = &self.tenants[job.tenant];
        t.quota.release(job.device, UsageClass::Data, job.bytes);
        self.node.release(job.device, UsageClass::Data, job.bytes);
        true
    }

    /// Bytes `tenant` holds on `device`.
    fn held(&self, tenant: usize, device: DeviceIndex) -> u64 {
        self.tenants[tenant].quota.usage(device).used
    }

    /// One line per tenant and GPU, then each GPU, then the counts.
    fn summary(&self) -> String {
        let gib = |b: u64| format!("{:.1} GiB", b as f64 / GIB as f64);
        let mut out = String::new();
        for t in &self.tenants {
            for d in (0..self.node.devices() as u32).map(DeviceIndex) {
                let u = t.quota.usage(d);
                let quota = u.limit.map_or("no quota".to_owned(), gib);
                out += &format!("  {:<6} GPU {d}: {:>8} of {quota}\n", t.name, gib(u.used));
            }
        }
        for d in (0..self.node.devices() as u32).map(DeviceIndex) {
            let u = self.node.usage(d);
            let cap = u.limit.unwrap_or(0);
            out += &format!(
                "  GPU {d}: {} used, {} free\n",
                gib(u.used),
                gib(cap - u.used)
            );
        }
        out += &format!(
            "  {} admitted, {} refused, {} running\n",
            self.admitted,
            self.refused,
            self.jobs.len()
        );
        out
    }
}

fn main() {
    // Two 80 GiB GPUs; "train" may use 60 GiB of each, "serve" 20 GiB of GPU 0 only,
    // "batch" has no quota of its own (only what the GPUs have left).
    let mut s = Scheduler::new(&[80 * GIB, 80 * GIB]);
    let train = s.tenant("train", &[Some(60 * GIB), Some(60 * GIB)]);
    let serve = s.tenant("serve", &[Some(20 * GIB), Some(0)]);
    let batch = s.tenant("batch", &[None, None]);
    let (gpu0, gpu1) = (DeviceIndex(0), DeviceIndex(1));

    let show = |what: &str, r: Result<String, Refusal>| match r {
        Ok(done) => println!("{what}: admitted, {done}"),
        Err(why) => println!("{what}: refused, {why}"),
    };
    let t1 = s.request(train, gpu0, 40 * GIB);
    show("train 40 GiB on GPU 0", t1.map(|j| format!("{j}")));
    let t2 = s.request(train, gpu0, 30 * GIB);
    show("train 30 GiB on GPU 0", t2.map(|j| format!("{j}")));
    let s1 = s.request(serve, gpu0, 16 * GIB);
    show("serve 16 GiB on GPU 0", s1.map(|j| format!("{j}")));
    let s2 = s.request(serve, gpu1, 1 << 20);
    show("serve 1 MiB on GPU 1", s2.map(|j| format!("{j}")));
    let b1 = s.request(batch, gpu0, 30 * GIB);
    show("batch 30 GiB on GPU 0", b1.map(|j| format!("{j}")));
    let b2 = s.place(batch, 30 * GIB);
    show(
        "batch 30 GiB anywhere",
        b2.map(|(d, j)| format!("{j} on GPU {d}")),
    );
    let t3 = s.place(train, 50 * GIB);
    show(
        "train 50 GiB anywhere",
        t3.map(|(d, j)| format!("{j} on GPU {d}")),
    );

    println!("\nafter admission:\n{}", s.summary());
    if let Ok(id) = t1 {
        s.finish(id);
        let held = s.held(train, gpu0) as f64 / GIB as f64;
        println!("train's 40 GiB job finished: train holds {held:.1} GiB on GPU 0");
    }
    let t4 = s.request(train, gpu0, 30 * GIB);
    show("train 30 GiB on GPU 0", t4.map(|j| format!("{j}")));
    println!("\nat the end:\n{}", s.summary());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> (Scheduler, usize, usize) {
        let mut s = Scheduler::new(&[10 * GIB, 10 * GIB, 10 * GIB]);
        let a = s.tenant("a", &[Some(6 * GIB), Some(6 * GIB), Some(0)]);
        let b = s.tenant("b", &[None, None, None]);
        (s, a, b)
    }

    #[test]
    fn a_quota_refuses_what_the_gpu_could_still_hold() {
        let (mut s, a, _) = node();
        let d = DeviceIndex(0);
        s.request(a, d, 4 * GIB).unwrap();
        match s.request(a, d, 3 * GIB) {
            Err(Refusal::Quota(oom)) => {
                assert_eq!((oom.in_use, oom.limit), (4 * GIB, 6 * GIB));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.node.usage(d).used, 4 * GIB, "the GPU had room");
        assert!(matches!(
            s.request(a, DeviceIndex(2), 1),
            Err(Refusal::Quota(_))
        ));
    }

    #[test]
    fn a_full_gpu_refuses_and_gives_the_quota_back() {
        let (mut s, a, b) = node();
        let d = DeviceIndex(1);
        s.request(b, d, 7 * GIB).unwrap();
        assert!(matches!(
            s.request(a, d, 4 * GIB),
            Err(Refusal::Capacity(_))
        ));
        assert_eq!(s.held(a, d), 0, "the refused request left no charge");
        s.request(a, d, 3 * GIB).unwrap();
        assert_eq!(s.node.usage(d).used, 10 * GIB);
    }

    #[test]
    fn placement_takes_the_emptiest_gpu_the_quota_allows() {
        let (mut s, a, b) = node();
        s.request(b, DeviceIndex(0), 5 * GIB).unwrap();
        s.request(b, DeviceIndex(1), 2 * GIB).unwrap();
        // GPU 2 is emptiest but a's quota there is 0: GPU 1 is next.
        let (d, _) = s.place(a, 5 * GIB).unwrap();
        assert_eq!(d, DeviceIndex(1));
        assert_eq!(s.place(a, 7 * GIB), Err(Refusal::NowhereFits));
        assert_eq!((s.admitted, s.refused), (3, 1));
    }

    #[test]
    fn finishing_a_job_frees_its_tenant_and_its_gpu() {
        let (mut s, a, _) = node();
        let d = DeviceIndex(0);
        let id = s.request(a, d, 6 * GIB).unwrap();
        assert!(s.request(a, d, 1).is_err());
        assert!(s.finish(id));
        assert!(!s.finish(id), "twice is refused");
        assert_eq!((s.held(a, d), s.node.usage(d).used), (0, 0));
        s.request(a, d, 6 * GIB).unwrap();
    }

    #[test]
    fn unknown_tenants_and_devices_are_refused() {
        let (mut s, a, _) = node();
        assert_eq!(s.request(9, DeviceIndex(0), 1), Err(Refusal::Unknown));
        assert_eq!(s.request(a, DeviceIndex(3), 1), Err(Refusal::Unknown));
    }

    #[test]
    fn the_summary_names_every_tenant_and_gpu() {
        let (mut s, a, _) = node();
        s.request(a, DeviceIndex(0), GIB).unwrap();
        let text = s.summary();
        assert!(text.contains("a      GPU 0:  1.0 GiB of 6.0 GiB"), "{text}");
        assert!(
            text.contains("GPU 2: 0.0 GiB used, 10.0 GiB free"),
            "{text}"
        );
        assert!(text.contains("1 admitted, 0 refused, 1 running"), "{text}");
    }
}
