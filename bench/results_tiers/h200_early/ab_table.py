# The A/B table (ab.md) of this directory's two rounds: µs a call (graph), each config's two
# rounds, and the faster round's ratio to the base.
import json, os
HERE = os.path.dirname(os.path.abspath(__file__))
cfgs=['base','early','base_nb','early_nb']
def t(r,c,m):
    d=json.load(open(f'{HERE}/r{r}/{c}/{m}.json'))
    return {(s['batch'],s['n_heads'],s['n_kv_heads'],s['head_dim'],s['ctx']):(s['time_us'],s['check']) for s in d['shapes']}
for m in ['tiers-4','tier-Q4Q3']:
    print('==',m)
    data={c:[t(r,c,m) for r in (1,2)] for c in cfgs}
    print('%-22s'%'shape'+''.join('%16s'%c for c in cfgs)+'   early/base  nb/base  early_nb/base')
    for k in data['base'][0]:
        v={c:min(data[c][0][k][0],data[c][1][k][0]) for c in cfgs}
        chk=all(data[c][r][k][1]=='pass' for c in cfgs for r in (0,1))
        rr=lambda c: '%.2f/%.2f'%(data[c][0][k][0],data[c][1][k][0])
        print('%-22s'%('B%d %d/%d D%d L%d'%k)+''.join('%16s'%rr(c) for c in cfgs)+'   %.3f  %.3f  %.3f %s'%(v['early']/v['base'],v['base_nb']/v['base'],v['early_nb']/v['base'],'' if chk else 'CHECK'))
