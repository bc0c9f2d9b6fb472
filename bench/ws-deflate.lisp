;;;; ws-deflate.lisp -- does permessage-deflate pay?  For messages of the
;;;; kinds apps send (a chat line, JSON events of 1 to 512 records), what
;;;; compression saves on the wire and what it costs in CPU, in this
;;;; process, on the paths a WebSocket runs (src/native/zlib.lisp):
;;;;
;;;;   - octets on the wire, each message compressed on its own (what Gallop
;;;;     agrees to) and with the context kept from message to message (what
;;;;     it declines: a deflate state of 256 KiB and a 32 KiB window per
;;;;     WebSocket, doc/design.md "WebSocket compression");
;;;;   - CPU µs per message: framing it as it is, compressing and framing
;;;;     it (WS-SEND), inflating it (a message received).
;;;;
;;;; Medians of 5 interleaved repeats.  `make bench-websockets` runs it
;;;; last and writes bench/results/STAMP-ws-deflate.md.

(require :asdf)
(push (truename ".") asdf:*central-registry*)
(asdf:load-system "gallop/native")

(defpackage #:gallop-bench-ws-deflate
  (:use #:common-lisp)
  (:export #:main))
(in-package #:gallop-bench-ws-deflate)

(defun octets (string) (sb-ext:string-to-octets string :external-format :utf-8))

(defun corpus (kind count)
  "COUNT messages of KIND, from a fixed random state."
  (let ((state (sb-ext:seed-random-state 11))
        (texts #("hello there" "ok" "see you at the meeting tomorrow" "did the deploy finish?"
                 "lgtm, merging")))
    (flet ((pick (v) (aref v (random (length v) state)))
           (record (i)
             (format nil "{\"id\": ~D, \"user\": \"user~D\", \"ts\": ~D, \"text\": \"~A\", ~
                          \"tags\": [\"chat\", \"room-~D\"]}"
                     i (1+ (random 500 state)) (+ 1764400000 i)
                     (aref texts (random 5 state)) (1+ (random 20 state)))))
      (loop for m below count
            collect (octets (if (eq kind :chat)
                                (format nil "alice: ~A" (pick texts))
                                (format nil "[~{~A~^, ~}]"
                                        (loop for j below kind collect (record (+ (* m kind) j))))))))))

(defun cpu-us ()
  (/ (* 1000000 (get-internal-run-time)) internal-time-units-per-second))

(defun timed (function messages)
  "CPU µs per message of FUNCTION over MESSAGES, run until 200 ms have passed."
  (let ((start (cpu-us)) (n 0))
    (loop do (dolist (m messages) (funcall function m) (incf n))
          until (> (- (cpu-us) start) 200000))
    (/ (- (cpu-us) start) n)))

(defun compressed (m)
  (multiple-value-bind (out length) (gallop::deflate-message m 15)
    (if out (subseq out 0 length) m)))

(defun with-tail (m) (concatenate 'gallop::octets m #(0 0 255 255)))

(defun kept-context-octets (messages)
  "Octets on the wire with the deflate context kept between messages."
  (let ((z (gallop::make-zstream nil 15)))
    (unwind-protect
         (loop for m in messages
               sum (let ((out (make-array (+ (length m) 64) :element-type '(unsigned-byte 8))))
                     (multiple-value-bind (result in-left out-left)
                         (gallop::zstream-run z m 0 (length m) out 0 (length out))
                       (declare (ignore result in-left))
                       (- (length out) out-left 4))))
      (gallop::free-zstream z))))

(defun median (list) (nth (floor (length list) 2) (sort (copy-list list) #'<)))

(defun measure (kind)
  (let* ((messages (corpus kind 200))
         (raw (reduce #'+ messages :key #'length))
         (own (reduce #'+ messages :key (lambda (m) (length (compressed m)))))
         (kept (kept-context-octets messages))
         (inflatable (mapcar (lambda (m) (with-tail (compressed m))) messages))
         (plain '()) (deflate '()) (inflate '()))
    (dotimes (repeat 5)
      (push (timed (lambda (m) (gallop::frame-octets 1 m)) messages) plain)
      (push (timed (lambda (m) (multiple-value-bind (out length) (gallop::deflate-message m 15)
                                 (if out
                                     (gallop::frame-octets 1 out 0 length t)
                                     (gallop::frame-octets 1 m))))
                   messages)
            deflate)
      (push (timed (lambda (m) (gallop::inflate-message m (length m) (* 16 1024 1024) (constantly t)))
                   inflatable)
            inflate))
    (list :kind (if (eq kind :chat) "chat line" (format nil "JSON, ~D record~:P" kind))
          :size (/ raw 200.0) :own (/ raw own 1.0) :kept (/ raw kept 1.0)
          :plain (median plain) :deflate (median deflate) :inflate (median inflate))))

(defun main ()
  (let* ((rows (mapcar #'measure '(:chat 1 8 64 512)))
         (stamp (multiple-value-bind (s mi h d mo y) (decode-universal-time (get-universal-time) 0)
                  (format nil "~D~2,'0D~2,'0D-~2,'0D~2,'0D~2,'0D" y mo d h mi s)))
         (file (merge-pathnames (format nil "bench/results/~A-ws-deflate.md" stamp)
                                (truename "."))))
    (with-open-file (out file :direction :output :if-exists :supersede)
      (format out "# permessage-deflate: what it saves and costs, ~A~%~%zlib ~A, level ~D, ~
                   window 2^15.  Method: bench/ws-deflate.lisp (one thread, CPU µs per message, ~
                   medians of 5 interleaved repeats).~%~%"
              stamp (gallop::zlib-version) gallop::+deflate-level+)
      (format out "| messages | octets each | wire ÷ compressed, each on its own | ~
                   with the context kept | CPU µs to frame | to compress and frame | to inflate |~%")
      (format out "|---|---|---|---|---|---|---|~%")
      (dolist (r rows)
        (format out "| ~A | ~:D | ~,2F | ~,2F | ~,2F | ~,1F | ~,1F |~%"
                (getf r :kind) (round (getf r :size)) (getf r :own) (getf r :kept)
                (getf r :plain) (getf r :deflate) (getf r :inflate))))
    (with-open-file (in file) (loop for line = (read-line in nil) while line do (write-line line)))
    (format t "~%Written: ~A~%" (enough-namestring file (truename ".")))))
