// SPDX-License-Identifier: GPL-2.0
/*
 * insnprof: a QEMU TCG plugin counting the guest instructions executed per
 * translation block, snapshotted when the guest executes a mark: the 8-byte
 * NOP "nopl MARK_BASE+code(%rax,%rax,1)" (0f 1f 84 00 <disp32>), which
 * mark() of bench/scenarios/common.py runs (NODROP_BENCH_MARK=1 in the
 * guest).  The snapshot is taken in the vCPU thread, at that instruction,
 * so it is exact in guest time.  The lab loads it with NODROP_INSNPROF=1
 * (bench/insnprof/build builds it):
 *
 *   -plugin <dir>/insnprof.so,arg=out=<results dir>/prof
 *
 * Each mark writes <prefix>.<n>.<code>: one record per block executed since
 * boot, { u64 vaddr; u64 executions; u32 instructions; u32 pad }.  Counts
 * are plain inline adds: exact under icount, where all vCPUs run in one
 * thread (with MTTCG they would race).  Build it against the qemu-plugin.h
 * of the QEMU that loads it (API version 1: QEMU 7.2).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

#define MARK_BASE	0x4e4f5000u	/* "NOP" */
#define MARK_CODES	0x1000u

struct block {
	uint64_t vaddr;
	uint64_t count;		/* executions, added to by the translated code */
	uint32_t insns;
	uint32_t next;		/* hash chain: index, 0 = end */
};

#define HASH_BITS	22
#define MAX_BLOCKS	(1u << 23)

static struct block *blocks;	/* blocks[0] unused */
static uint32_t nblocks, overflow;
static uint32_t *heads;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static const char *out;
static unsigned int snaps;

static uint32_t hash(uint64_t va, uint32_t n)
{
	return (uint32_t)(((va ^ ((uint64_t)n << 48)) * 0x9e3779b97f4a7c15ull) >>
			  (64 - HASH_BITS));
}

static void snapshot(unsigned int code)
{
	char path[4096];
	uint32_t i;
	FILE *f;

	snprintf(path, sizeof(path), "%s.%u.%u", out, snaps++, code);
	f = fopen(path, "w");
	if (!f) {
		fprintf(stderr, "insnprof: %s: %s\n", path, strerror(errno));
		return;
	}
	pthread_mutex_lock(&lock);
	for (i = 1; i <= nblocks; i++) {
		struct { uint64_t va, count; uint32_t insns, pad; } r = {
			blocks[i].vaddr, blocks[i].count, blocks[i].insns, 0 };

		if (r.count)
			fwrite(&r, sizeof(r), 1, f);
	}
	pthread_mutex_unlock(&lock);
	fclose(f);
	if (overflow)
		fprintf(stderr, "insnprof: %u blocks not counted (table full)\n", overflow);
}

static void on_mark(unsigned int vcpu, void *code)
{
	(void)vcpu;
	snapshot((unsigned int)(uintptr_t)code);
}

static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
	uint64_t va = qemu_plugin_tb_vaddr(tb);
	size_t k, n = qemu_plugin_tb_n_insns(tb);
	uint32_t h = hash(va, n), i;

	(void)id;
	for (k = 0; k < n; k++) {
		struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, k);
		const unsigned char *b = qemu_plugin_insn_data(insn);
		uint32_t disp;

		if (qemu_plugin_insn_size(insn) != 8 || b[0] != 0x0f || b[1] != 0x1f ||
		    b[2] != 0x84 || b[3] != 0x00)
			continue;
		memcpy(&disp, b + 4, 4);
		if (disp - MARK_BASE < MARK_CODES)
			qemu_plugin_register_vcpu_insn_exec_cb(insn, on_mark, QEMU_PLUGIN_CB_NO_REGS,
							       (void *)(uintptr_t)(disp - MARK_BASE));
	}
	pthread_mutex_lock(&lock);
	for (i = heads[h]; i; i = blocks[i].next)
		if (blocks[i].vaddr == va && blocks[i].insns == n)
			break;
	if (!i) {
		if (nblocks + 1 >= MAX_BLOCKS) {
			overflow++;
			pthread_mutex_unlock(&lock);
			return;
		}
		i = ++nblocks;
		blocks[i] = (struct block){ .vaddr = va, .insns = n, .next = heads[h] };
		heads[h] = i;
	}
	pthread_mutex_unlock(&lock);
	qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64,
						 &blocks[i].count, 1);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
					   int argc, char **argv)
{
	int i;

	(void)info;
	for (i = 0; i < argc; i++)
		if (!strncmp(argv[i], "out=", 4))
			out = argv[i] + 4;
	if (!out) {
		fprintf(stderr, "insnprof: needs arg=out=<prefix>\n");
		return -1;
	}
	blocks = calloc(MAX_BLOCKS, sizeof(*blocks));
	heads = calloc(1u << HASH_BITS, sizeof(*heads));
	if (!blocks || !heads)
		return -1;
	qemu_plugin_register_vcpu_tb_trans_cb(id, tb_trans);
	return 0;
}
