#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t pool_bytes=(size_t)1<<30; char* pool=aligned_alloc(4096,pool_bytes);
  for(size_t i=0;i<pool_bytes;i+=4096) pool[i]=1;
  int ahead=argc>1?atoi(argv[1]):0;
  for(int ck=2;ck<=64;ck*=2){
    size_t C=ck*1024, n=pool_bytes/C, reads=(64u<<20)/C;
    uint32_t* idx=malloc(sizeof(uint32_t)*reads*2);
    double best=1e9;
    for(int rep=0;rep<6;rep++){
      for(size_t i=0;i<reads*2;i++) idx[i]=(uint32_t)(((uint64_t)rand()*2654435761u)%n);
      double t=now(); float tot=0;
      #pragma omp parallel num_threads(2) reduction(+:tot)
      { int th=omp_get_thread_num(); __m512 acc=_mm512_setzero_ps();
        for(size_t r=th;r<reads;r+=2){ const char* p=pool+(size_t)idx[r]*C;
          if(ahead){ const char* q=pool+(size_t)idx[r+2*ahead]*C; for(size_t o=0;o<C;o+=64) _mm_prefetch(q+o,_MM_HINT_T0);}
          for(size_t o=0;o<C;o+=64) acc=_mm512_add_ps(acc,_mm512_load_ps((const float*)(p+o))); }
        tot+=_mm512_reduce_add_ps(acc); }
      double dt=now()-t; if(dt<best)best=dt; if(tot==12345)puts("");
    }
    printf("%2d KB chunks, prefetch %d ahead: %.1f GB/s\n",ck,ahead,(double)reads*C/best/1e9);
  }
  return 0;}
